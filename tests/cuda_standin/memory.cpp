// Device memory, pinned host memory, copies, memsets, symbols and the stream-ordered allocator.

#include "standin.h"

#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

// Note [Stand-in memory]
// Device memory is host memory that host code cannot touch: cudaMalloc (and cudaMallocAsync, a
// __device__ variable, cuMemCreate's memory mapped by cuMemMap: driver.cpp) is a memory file
// mapped twice -- at the address handed out (page aligned), PROT_NONE, so that a host read or
// write of a CUDA pointer (a host function, a ctypes read, C++ that dereferences a tensor's
// data_ptr()) dies with SIGSEGV as it does on a GPU; and read-write at a second address, the
// allocation's view, that only the stand-in knows and through which its own copies, memsets,
// graph nodes and poisoning move the bytes (hostView()). No bytes ever pass through the device
// addresses, so no window opens for other threads. Pinned memory (cudaHostAlloc,
// cudaHostRegister) stays host memory, readable and writable as on hardware (managed memory is
// not modelled). CUDA_STANDIN_HOST_ACCESS=1 (for debugging) maps the device addresses read-write
// too: the same pages, so both see the same bytes. Device memory is counted against a
// capacity (CUDA_STANDIN_MEMORY, default 16 GiB, standin_set_capacity()); past it, and at an
// allocation armed with standin_fail_allocation(), it fails with cudaErrorMemoryAllocation as a
// full device does. New memory is poisoned (CUDA_STANDIN_POISON, 0xFF by default: a float NaN),
// so a value that no copy wrote -- a kernel's output, since kernels never run -- is visibly not
// a result. Every allocation is in one map: a copy or memset checks that each device-side range
// lies inside one live allocation (cudaErrorInvalidValue otherwise; a graph node or queued work
// that finds its memory gone is a sticky device fault, as an illegal address is on a GPU).
// Copies and memsets really move bytes, in stream order (Note [Stand-in streams]). Pinned memory
// (cudaHostAlloc, cudaHostRegister) is host memory the map knows, so copies from it are
// asynchronous and may be captured; a copy from pageable memory is synchronous (staged at the
// call, as the runtime does) and is refused inside a capture. cudaFree and cudaFreeHost wait
// for the whole device, as they do on a GPU. The stream-ordered allocator (cudaMallocAsync) is
// eager; inside a capture it would need memory-allocation nodes, which are not modelled.
// The value mode (Note [Stand-in values] in values.cpp) reads and writes device bytes only through
// standin_host_view (the allocation's view, in the engine's host work); it keeps here the ranges
// of device bytes whose values are unknown: a copy carries its source's state, a memset and a
// freed allocation are known, a kernel no engine op computed makes its arguments' memory unknown
// (kernels.cpp). A device-to-host copy made while an engine op computes is refused: that op's
// CUDA kernel reads values the engine computes only after it.

namespace standin {

namespace {

std::map<uintptr_t, Allocation>& allocations() {
  static auto* m = new std::map<uintptr_t, Allocation>();
  return *m;
}
int64_t fail_at = 0;     // standin_fail_allocation: 1 = the next allocation fails
int64_t fail_count = 0;  // how many fail from there

// Async-pool bookkeeping (cudaMallocAsync).
std::map<uintptr_t, size_t>& asyncAllocations() {
  static auto* m = new std::map<uintptr_t, size_t>();
  return *m;
}
size_t async_high = 0;
uint64_t release_threshold = 0;
struct CUmemPoolHandle_st* const kDefaultPool =
    reinterpret_cast<struct CUmemPoolHandle_st*>(0x5700);

// Symbols: host shadow variable -> device copy.
std::map<const void*, std::pair<void*, size_t>>& symbols() {
  static auto* m = new std::map<const void*, std::pair<void*, size_t>>();
  return *m;
}

// A pointer's side of a copy: device memory, pinned host memory, or pageable (unknown) host.
enum class Side { kDevice, kPinned, kPageable };

Side sideOf(const void* p) {
  const Allocation* a = findAllocation(p);
  if (a == nullptr) return Side::kPageable;
  return isDeviceKind(a->kind) ? Side::kDevice : Side::kPinned;
}

// Checks one side of a copy of `extent` bytes; the error for a device range that is not inside
// one live allocation.
cudaError_t checkSide(const void* p, size_t extent, bool must_be_device, const char* call,
                      const char* which) {
  if (extent == 0) return cudaSuccess;
  if (p == nullptr) return fail(cudaErrorInvalidValue, "%s: %s is NULL", call, which);
  const Allocation* a = findAllocation(p);
  if (a == nullptr) {
    if (must_be_device) {
      return fail(cudaErrorInvalidValue, "%s: %s %s is not in any live device allocation", call,
                  which, hex(p).c_str());
    }
    return cudaSuccess;
  }
  if (must_be_device && !isDeviceKind(a->kind)) {
    return fail(cudaErrorInvalidValue, "%s: %s %s is host memory, the copy's kind says device",
                call, which, hex(p).c_str());
  }
  if (reinterpret_cast<uintptr_t>(p) + extent > a->base + a->size) {
    return fail(cudaErrorInvalidValue,
                "%s: %s [%s, +%zu) runs past the end of its allocation [%s, +%zu)", call, which,
                hex(p).c_str(), extent, hex(reinterpret_cast<void*>(a->base)).c_str(), a->size);
  }
  return cudaSuccess;
}

void* allocateHost(size_t size) {
  void* p = nullptr;
  if (posix_memalign(&p, 4096, size == 0 ? 1 : size) != 0) return nullptr;
  return p;
}

size_t pageRound(size_t n) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return ((n == 0 ? 1 : n) + page - 1) / page * page;
}

// Device memory of `size` bytes (Note [Stand-in memory]): returns the device address, PROT_NONE
// to the host, and sets *view to the stand-in's read-write mapping of the same pages; nullptr
// if the host is out of memory (or mappings).
void* mapDevice(size_t size, void** view) {
  const size_t len = pageRound(size);
  const int fd = memfd_create("cuda-standin-device", MFD_CLOEXEC);
  if (fd < 0) return nullptr;
  void* device = MAP_FAILED;
  void* v = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(len)) == 0) {
    v = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    device = mmap(nullptr, len, config().host_access ? PROT_READ | PROT_WRITE : PROT_NONE,
                  MAP_SHARED, fd, 0);
  }
  close(fd);  // the mappings keep the memory
  if (device == MAP_FAILED || v == MAP_FAILED) {
    if (device != MAP_FAILED) munmap(device, len);
    if (v != MAP_FAILED) munmap(v, len);
    return nullptr;
  }
  *view = v;
  return device;
}

// Device memory for a __device__ variable (never freed): the thousands that torch's libraries
// register as they load are carved, 256-byte aligned, out of shared 2 MiB device mappings, so
// that they take a few mappings rather than two each.
void* mapSymbol(size_t size, void** view) {
  constexpr size_t kArena = size_t(2) << 20;
  static char* arena = nullptr;
  static char* arena_view = nullptr;
  static size_t left = 0;
  const size_t need = ((size == 0 ? 1 : size) + 255) & ~size_t(255);
  if (need > kArena / 4) return mapDevice(size, view);
  if (need > left) {
    void* v = nullptr;
    void* p = mapDevice(kArena, &v);
    if (p == nullptr) return nullptr;
    arena = static_cast<char*>(p);
    arena_view = static_cast<char*>(v);
    left = kArena;
  }
  void* p = arena;
  *view = arena_view;
  arena += need;
  arena_view += need;
  left -= need;
  return p;
}

void unmapDevice(const Allocation& a) {
  const size_t len = pageRound(a.size);
  munmap(reinterpret_cast<void*>(a.base), len);
  munmap(reinterpret_cast<void*>(a.view), len);
}

// A copy or memset, submitted to `stream`: a capture node, or queued work.
cudaError_t submit(CUstream_st* s, NodeData n, const char* call, bool host_sync,
                   const void* pageable_src) {
  bool captured = false;
  cudaError_t e = captureCheck(s, call, &captured);
  if (e != cudaSuccess) return e;
  if (captured) {
    if (pageable_src != nullptr || host_sync) {
      invalidate(s->capture, std::string(call) + " with pageable host memory");
      return fail(cudaErrorStreamCaptureUnsupported,
                  "%s: a copy to or from pageable host memory cannot be captured", call);
    }
    addCaptureNode(s, std::move(n));
    return cudaSuccess;
  }
  std::shared_ptr<std::vector<char>> staged;
  if (pageable_src != nullptr) {
    // The runtime stages pageable sources before it returns: later changes do not count.
    const size_t extent = n.height == 0 ? 0 : (n.height - 1) * n.spitch + n.width;
    staged = std::make_shared<std::vector<char>>(static_cast<const char*>(pageable_src),
                                                 static_cast<const char*>(pageable_src) + extent);
    n.src = staged->data();
  }
  const uint64_t seq = enqueue(s, call, [n, staged, call] { executeNode(n, call); });
  if (host_sync) runUpTo(s, seq);
  return cudaSuccess;
}

cudaError_t copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                   size_t height, cudaMemcpyKind kind, cudaStream_t stream, const char* call,
                   bool sync) {
  Lock lock;
  if (stickyError() != cudaSuccess) return setError(stickyError());
  if (width == 0 || height == 0) return cudaSuccess;
  if (height > 1 && (dpitch < width || spitch < width)) {
    return fail(cudaErrorInvalidValue, "%s: pitch smaller than the width", call);
  }
  const size_t dext = (height - 1) * dpitch + width;
  const size_t sext = (height - 1) * spitch + width;
  const Side ds = sideOf(dst), ss = sideOf(src);
  bool dst_dev = false, src_dev = false;
  switch (kind) {
    case cudaMemcpyHostToDevice:
      dst_dev = true;
      break;
    case cudaMemcpyDeviceToHost:
      src_dev = true;
      break;
    case cudaMemcpyDeviceToDevice:
      dst_dev = src_dev = true;
      break;
    case cudaMemcpyHostToHost:
      break;
    case cudaMemcpyDefault:
      dst_dev = ds == Side::kDevice;
      src_dev = ss == Side::kDevice;
      break;
    default:
      return fail(cudaErrorInvalidValue, "%s: copy kind %d", call, (int)kind);
  }
  cudaError_t e = checkSide(dst, dext, dst_dev, call, "the destination");
  if (e == cudaSuccess) e = checkSide(src, sext, src_dev, call, "the source");
  if (e != cudaSuccess) return e;
  if (valuesComputing() && src_dev && !dst_dev) {
    // Note [Stand-in values] (values.cpp): the op's own CUDA kernel reads device values back
    // (a count, a flag) that the engine computes only after it, in stream order.
    return fail(cudaErrorNotSupported,
                "value mode: %s copies device memory to the host inside its CUDA kernel, so it "
                "would read values not computed yet: it belongs in values.cpp's table of "
                "data-dependent ops (computed first)",
                valuesOp());
  }
  CUstream_st* s = sync ? legacyStream() : resolveStream(stream, call);
  if (s == nullptr)
    return fail(cudaErrorInvalidResourceHandle, "%s: unknown stream %s", call, hex(stream).c_str());
  NodeData n;
  n.kind = NodeKind::kMemcpy;
  n.name = call;
  n.dst = dst;
  n.src = src;
  n.width = width;
  n.height = height;
  n.dpitch = height > 1 ? dpitch : width;
  n.spitch = height > 1 ? spitch : width;
  n.dst_known = ds != Side::kPageable;
  n.src_known = ss != Side::kPageable;
  n.op_computes = valuesComputing() && dst_dev && src_dev;
  // A pageable destination makes the call synchronous; a pageable source is staged.
  const bool host_sync = sync || (!dst_dev && ds == Side::kPageable);
  const void* pageable_src = (!src_dev && ss == Side::kPageable) ? src : nullptr;
  return submit(s, std::move(n), call, host_sync, pageable_src);
}

cudaError_t memset2D(void* p, unsigned value, unsigned elem, size_t width, size_t height,
                     size_t pitch, cudaStream_t stream, const char* call) {
  Lock lock;
  if (stickyError() != cudaSuccess) return setError(stickyError());
  if (width == 0 || height == 0) return cudaSuccess;
  cudaError_t e = checkSide(p, (height - 1) * pitch + width * elem, true, call, "the destination");
  if (e != cudaSuccess) return e;
  CUstream_st* s = resolveStream(stream, call);
  if (s == nullptr)
    return fail(cudaErrorInvalidResourceHandle, "%s: unknown stream %s", call, hex(stream).c_str());
  NodeData n;
  n.kind = NodeKind::kMemset;
  n.name = call;
  n.dst = p;
  n.value = value;
  n.elem = elem;
  n.width = width;
  n.height = height;
  n.dpitch = height > 1 ? pitch : width * elem;
  n.dst_known = true;
  return submit(s, std::move(n), call, false, nullptr);
}

}  // namespace

const Allocation* findAllocation(const void* p) {
  auto& m = allocations();
  const auto addr = reinterpret_cast<uintptr_t>(p);
  auto it = m.upper_bound(addr);
  if (it == m.begin()) return nullptr;
  --it;
  const Allocation& a = it->second;
  return addr >= a.base && addr < a.base + a.size ? &a : nullptr;
}

namespace {
bool inside(const void* p, size_t n, const Allocation* a) {
  return a != nullptr && reinterpret_cast<uintptr_t>(p) + n <= a->base + a->size;
}
}  // namespace

bool isDeviceRange(const void* p, size_t n) {
  const Allocation* a = findAllocation(p);
  return a != nullptr && isDeviceKind(a->kind) && inside(p, n, a);
}

bool isPinned(const void* p, size_t n) {
  const Allocation* a = findAllocation(p);
  return a != nullptr && !isDeviceKind(a->kind) && inside(p, n, a);
}

void registerAllocation(uintptr_t base, size_t size, MemKind kind, uintptr_t view) {
  allocations()[base] = Allocation{base, size, kind, view != 0 ? view : base};
}

void* hostView(const void* p) {
  const Allocation* a = findAllocation(p);
  if (a == nullptr) return const_cast<void*>(p);
  return reinterpret_cast<void*>(a->view + (reinterpret_cast<uintptr_t>(p) - a->base));
}

void unregisterAllocation(uintptr_t base) {
  allocations().erase(base);
}

bool reserveDeviceBytes(size_t n) {
  StandinStats& st = stats();
  if (fail_at > 0 && --fail_at == 0) {
    if (--fail_count > 0) fail_at = 1;
    st.oom++;
    return false;
  }
  if (static_cast<size_t>(st.bytes_in_use) + n > config().capacity) {
    st.oom++;
    return false;
  }
  st.bytes_in_use += static_cast<int64_t>(n);
  if (st.bytes_in_use > st.peak_bytes) st.peak_bytes = st.bytes_in_use;
  return true;
}

void releaseDeviceBytes(size_t n) {
  stats().bytes_in_use -= static_cast<int64_t>(n);
}

void poison(void* p, size_t n) {
  if (config().poison >= 0) std::memset(p, config().poison, n);
}

namespace {
bool executeWork(const NodeData& n, const char* where);
bool setHandle(const NodeData& n, const char* where);
bool runConditional(const NodeData& n, const char* where);
}  // namespace

// A node's work, then the value engine's computation attached to it, if the work did not fault.
void executeNode(const NodeData& n, const char* where) {
  if (executeWork(n, where) && n.then_fn != nullptr) {
    runUnlocked([&] { n.then_fn(n.then_data); });
  }
}

namespace {
// A node's work: copies and memsets move bytes after checking that their device ranges are still
// allocated (a fault otherwise: false); kernels are counted only; host functions run.
bool executeWork(const NodeData& n, const char* where) {
  switch (n.kind) {
    case NodeKind::kMemcpy: {
      const size_t dext = (n.height - 1) * n.dpitch + n.width;
      const size_t sext = (n.height - 1) * n.spitch + n.width;
      if (n.dst_known && !inside(n.dst, dext, findAllocation(n.dst))) {
        deviceFault("%s (%s): writes [%s, +%zu), which is no longer allocated", where,
                    n.name.c_str(), hex(n.dst).c_str(), dext);
        return false;
      }
      if (n.src_known && !inside(n.src, sext, findAllocation(n.src))) {
        deviceFault("%s (%s): reads [%s, +%zu), which is no longer allocated", where,
                    n.name.c_str(), hex(n.src).c_str(), sext);
        return false;
      }
      if (n.op_computes) return true;
      char* dst = static_cast<char*>(hostView(n.dst));
      const char* src = static_cast<const char*>(hostView(n.src));
      for (size_t r = 0; r < n.height; ++r) {
        std::memmove(dst + r * n.dpitch, src + r * n.spitch, n.width);
      }
      // The value mode: a copy carries its source's knownness (host bytes are known); one that
      // brings unknown bytes to the host is counted (conftest.py names the tests that did).
      if (anyUnknown(reinterpret_cast<uintptr_t>(n.src), sext)) {
        if (!isDeviceRange(n.dst, dext)) stats().unknown_reads++;
        markUnknown(reinterpret_cast<uintptr_t>(n.dst), dext);
      } else {
        markKnown(reinterpret_cast<uintptr_t>(n.dst), dext);
      }
      stats().copies++;
      return true;
    }
    case NodeKind::kMemset: {
      const size_t ext = (n.height - 1) * n.dpitch + n.width * n.elem;
      if (!isDeviceRange(n.dst, ext)) {
        deviceFault("%s (%s): sets [%s, +%zu), which is no longer allocated", where, n.name.c_str(),
                    hex(n.dst).c_str(), ext);
        return false;
      }
      if (n.op_computes) return true;
      char* dst = static_cast<char*>(hostView(n.dst));
      for (size_t r = 0; r < n.height; ++r) {
        char* row = dst + r * n.dpitch;
        if (n.elem == 1) {
          std::memset(row, static_cast<int>(n.value & 0xFF), n.width);
        } else if (n.elem == 2) {
          auto* q = reinterpret_cast<uint16_t*>(row);
          for (size_t i = 0; i < n.width; ++i) q[i] = static_cast<uint16_t>(n.value);
        } else {
          auto* q = reinterpret_cast<uint32_t*>(row);
          for (size_t i = 0; i < n.width; ++i) q[i] = n.value;
        }
      }
      markKnown(reinterpret_cast<uintptr_t>(n.dst), ext);
      stats().copies++;
      return true;
    }
    case NodeKind::kHost:
      if (n.fn != nullptr) runUnlocked([&] { n.fn(n.user_data); });
      return true;
    case NodeKind::kEventRecord:
      if (n.event != nullptr) n.event->time_ms = nowMs();
      return true;
    case NodeKind::kKernel:
      if (n.sets_handle != 0) return setHandle(n, where);
      if (n.unknown != nullptr) {
        for (const auto& r : *n.unknown) markUnknown(r.first, r.second);
      }
      return true;
    case NodeKind::kEmpty:
      return true;
    case NodeKind::kConditional:
      return runConditional(n, where);
  }
  return true;
}

// Note [Stand-in conditional nodes] in capture.cpp: the kernel that sets a handle from a
// predicate's byte, run by the stand-in.
bool setHandle(const NodeData& n, const char* where) {
  if (!isDeviceRange(n.predicate, 1)) {
    deviceFault("%s (%s): reads its predicate at %s, which is not allocated device memory", where,
                n.name.c_str(), hex(n.predicate).c_str());
    return false;
  }
  if (valuesEngine() && anyUnknown(reinterpret_cast<uintptr_t>(n.predicate), 1)) {
    deviceFault(
        "%s (%s): its predicate at %s has no known value (no value engine op computed "
        "it), so the stand-in cannot tell which body a GPU would run",
        where, n.name.c_str(), hex(n.predicate).c_str());
    return false;
  }
  const auto* byte = static_cast<const unsigned char*>(hostView(n.predicate));
  setConditionalValue(n.sets_handle, *byte != 0 ? 1u : 0u);
  return true;
}

bool runConditional(const NodeData& n, const char* where) {
  auto body = [&](size_t i) {
    stats().conditional_runs++;
    for (const NodeData& b : *n.body_nodes[i]) {
      executeNode(b, where);
      if (stickyError() != cudaSuccess) return false;
    }
    return true;
  };
  const unsigned value = conditionalValue(n.cond_handle);
  switch (n.cond_type) {
    case cudaGraphCondTypeIf:
      if (value != 0) return body(0);
      return n.body_nodes.size() < 2 || body(1);
    case cudaGraphCondTypeWhile: {
      int64_t k = 0;
      while (conditionalValue(n.cond_handle) != 0) {
        if (++k > whileLimit()) {
          deviceFault(
              "%s (%s): still running after %lld iterations (CUDA_STANDIN_WHILE_LIMIT): "
              "its predicate never became false",
              where, n.name.c_str(), (long long)whileLimit());
          return false;
        }
        if (!body(0)) return false;
      }
      return true;
    }
    case cudaGraphCondTypeSwitch:
      return value >= n.body_nodes.size() || body(value);
    default:
      return true;
  }
}
}  // namespace

// ---- the value mode's bookkeeping (Note [Stand-in values] in values.cpp) ----------------------

namespace {
std::atomic<bool> values_engine{false};
thread_local int values_depth = 0;
thread_local const char* values_op = "";
thread_local CUstream_st* values_node_stream = nullptr;  // noteValuesNode
thread_local CUgraphNode_st* values_node = nullptr;
// Unknown device bytes: disjoint [start, end) intervals, start -> end. Its own mutex, so that the
// engine's host work (which runs without the stand-in's lock) marks and asks cheaply; `unknown_n`
// lets the common case (nothing unknown) skip the mutex.
std::mutex& unknownMutex() {
  static auto* m = new std::mutex();
  return *m;
}
std::map<uintptr_t, uintptr_t>& unknownRanges() {
  static auto* m = new std::map<uintptr_t, uintptr_t>();
  return *m;
}
std::atomic<size_t> unknown_n{0};
std::atomic<int64_t> uncomputed{0};
std::string& lastUncomputed() {
  static auto* s = new std::string();
  return *s;
}

// Removes [lo, hi) from the set (the lock held).
void eraseRange(std::map<uintptr_t, uintptr_t>& m, uintptr_t lo, uintptr_t hi) {
  auto it = m.upper_bound(lo);
  if (it != m.begin()) --it;
  while (it != m.end() && it->first < hi) {
    const uintptr_t s = it->first, e = it->second;
    if (e <= lo) {
      ++it;
      continue;
    }
    it = m.erase(it);
    if (s < lo) m[s] = lo;
    if (e > hi) {
      m[hi] = e;
      break;
    }
  }
}

// Reads 8 bytes at `addr` without faulting (an address that is not readable answers false).
bool safeRead(uintptr_t addr, uint64_t* out) {
  struct iovec local{out, sizeof(*out)};
  struct iovec remote{reinterpret_cast<void*>(addr), sizeof(*out)};
  return process_vm_readv(getpid(), &local, 1, &remote, 1, 0) == sizeof(*out);
}
}  // namespace

void noteValuesNode(CUstream_st* s, CUgraphNode_st* node) {
  if (values_depth == 0) return;
  const NodeKind k = node->data.kind;
  if (k != NodeKind::kKernel && k != NodeKind::kMemcpy && k != NodeKind::kMemset) return;
  values_node_stream = s;
  values_node = node;
}

CUgraphNode_st* valuesNode(CUstream_st* s) {
  return values_node_stream == s ? values_node : nullptr;
}

bool valuesEngine() {
  return values_engine.load(std::memory_order_relaxed);
}
bool valuesComputing() {
  return values_depth > 0;
}
const char* valuesOp() {
  return values_op;
}

void markUnknown(uintptr_t p, size_t n) {
  if (n == 0) return;
  std::lock_guard<std::mutex> g(unknownMutex());
  auto& m = unknownRanges();
  uintptr_t lo = p, hi = p + n;
  // Merge with the neighbours it overlaps or touches.
  auto it = m.upper_bound(lo);
  if (it != m.begin()) {
    auto prev = std::prev(it);
    if (prev->second >= lo) {
      lo = prev->first;
      hi = std::max(hi, prev->second);
      m.erase(prev);
    }
  }
  it = m.lower_bound(lo);
  while (it != m.end() && it->first <= hi) {
    hi = std::max(hi, it->second);
    it = m.erase(it);
  }
  m[lo] = hi;
  unknown_n.store(m.size(), std::memory_order_release);
}

void markKnown(uintptr_t p, size_t n) {
  if (n == 0 || unknown_n.load(std::memory_order_acquire) == 0) return;
  std::lock_guard<std::mutex> g(unknownMutex());
  eraseRange(unknownRanges(), p, p + n);
  unknown_n.store(unknownRanges().size(), std::memory_order_release);
}

bool anyUnknown(uintptr_t p, size_t n) {
  if (n == 0 || unknown_n.load(std::memory_order_acquire) == 0) return false;
  std::lock_guard<std::mutex> g(unknownMutex());
  auto& m = unknownRanges();
  auto it = m.upper_bound(p);
  if (it != m.begin() && std::prev(it)->second > p) return true;
  return it != m.end() && it->first < p + n;
}

std::vector<std::pair<uintptr_t, size_t>> pointerArgRanges(void** params) {
  std::vector<std::pair<uintptr_t, size_t>> out;
  if (params == nullptr) return out;
  // The argument count is in the kernel's image, which the stand-in does not parse: read up to
  // kMax slots (past the real ones they hold whatever follows the array; a stray device pointer
  // among them only marks more memory unknown, never less).
  constexpr int kMax = 24;
  for (int i = 0; i < kMax; ++i) {
    uint64_t slot = 0, value = 0;
    if (!safeRead(reinterpret_cast<uintptr_t>(params + i), &slot)) break;
    if (slot == 0 || !safeRead(slot, &value)) continue;
    const Allocation* a = findAllocation(reinterpret_cast<const void*>(value));
    if (a == nullptr || !isDeviceKind(a->kind)) continue;
    out.emplace_back(value, a->base + a->size - value);
  }
  return out;
}

void noteUncomputedLaunch(const char* name) {
  uncomputed++;
  std::lock_guard<std::mutex> g(unknownMutex());
  lastUncomputed() = name;
}

}  // namespace standin

using namespace standin;

extern "C" {

__attribute__((visibility("default"))) void* standin_host_view(const void* p, size_t n) {
  Lock lock;
  const Allocation* a = findAllocation(p);
  if (a == nullptr || !isDeviceKind(a->kind) || !inside(p, n == 0 ? 1 : n, a)) {
    fail(cudaErrorInvalidValue,
         "standin_host_view(%s, %zu): not inside one live device allocation (or one contiguous "
         "mapped run of an expandable segment)",
         hex(p).c_str(), n);
    return nullptr;
  }
  return hostView(p);
}

__attribute__((visibility("default"))) void standin_values_engine(int on) {
  values_engine.store(on != 0);
}
__attribute__((visibility("default"))) int standin_values_active(void) {
  return values_engine.load() ? 1 : 0;
}
__attribute__((visibility("default"))) void standin_values_enter(const char* op) {
  if (values_depth++ == 0) {
    values_op = op != nullptr ? op : "?";
    values_node_stream = nullptr;
    values_node = nullptr;
  }
}
__attribute__((visibility("default"))) void standin_values_exit(void) {
  values_depth--;
}
__attribute__((visibility("default"))) int standin_values_computing(void) {
  return values_depth > 0 ? 1 : 0;
}
__attribute__((visibility("default"))) void standin_values_mark(const void* p, size_t n,
                                                                int unknown) {
  if (unknown) {
    markUnknown(reinterpret_cast<uintptr_t>(p), n);
  } else {
    markKnown(reinterpret_cast<uintptr_t>(p), n);
  }
}
__attribute__((visibility("default"))) int standin_values_unknown(const void* p, size_t n) {
  return anyUnknown(reinterpret_cast<uintptr_t>(p), n == 0 ? 1 : n) ? 1 : 0;
}
__attribute__((visibility("default"))) void standin_values_note(const char* what) {
  noteUncomputedLaunch(what);
}

__attribute__((visibility("default"))) int64_t standin_values_uncomputed(char* last_name,
                                                                         size_t len) {
  if (last_name != nullptr && len > 0) {
    std::lock_guard<std::mutex> g(unknownMutex());
    std::snprintf(last_name, len, "%s", lastUncomputed().c_str());
  }
  return uncomputed.load();
}

}  // extern "C"

extern "C" {

cudaError_t cudaMalloc(void** devPtr, size_t size) {
  Lock lock;
  if (devPtr == nullptr) return setError(cudaErrorInvalidValue);
  cudaError_t e = checkUnsafe("cudaMalloc");
  if (e != cudaSuccess) return e;
  if (stickyError() != cudaSuccess) return setError(stickyError());
  if (size == 0) {
    *devPtr = nullptr;
    return cudaSuccess;
  }
  const size_t rounded = (size + 511) & ~size_t(511);
  if (!reserveDeviceBytes(rounded)) {
    return fail(cudaErrorMemoryAllocation,
                "cudaMalloc(%zu): out of memory (%lld of %zu bytes in use)", size,
                (long long)stats().bytes_in_use, config().capacity);
  }
  void* view = nullptr;
  void* p = mapDevice(rounded, &view);
  if (p == nullptr) {
    releaseDeviceBytes(rounded);
    return fail(cudaErrorMemoryAllocation, "cudaMalloc(%zu): the host is out of memory", size);
  }
  poison(view, rounded);
  registerAllocation(reinterpret_cast<uintptr_t>(p), rounded, MemKind::kDevice,
                     reinterpret_cast<uintptr_t>(view));
  stats().mallocs++;
  *devPtr = p;
  trace("cudaMalloc(%zu) = %p", size, p);
  return cudaSuccess;
}

cudaError_t cudaFree(void* devPtr) {
  Lock lock;
  if (devPtr == nullptr) return cudaSuccess;
  cudaError_t e = checkUnsafe("cudaFree");
  if (e != cudaSuccess) return e;
  const Allocation* a = findAllocation(devPtr);
  if (a == nullptr || a->base != reinterpret_cast<uintptr_t>(devPtr) ||
      a->kind != MemKind::kDevice) {
    return fail(cudaErrorInvalidValue, "cudaFree(%s): not the start of a cudaMalloc allocation",
                hex(devPtr).c_str());
  }
  runAll();  // cudaFree waits for the device
  const Allocation gone = *a;
  markKnown(gone.base, gone.size);  // the value mode: fresh memory is poison, not unknown
  unregisterAllocation(gone.base);
  releaseDeviceBytes(gone.size);
  unmapDevice(gone);
  stats().frees++;
  trace("cudaFree(%p)", devPtr);
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  Lock lock;
  const size_t used = static_cast<size_t>(stats().bytes_in_use);
  if (free_bytes) *free_bytes = config().capacity > used ? config().capacity - used : 0;
  if (total) *total = config().capacity;
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** pHost, size_t size, unsigned int /*flags*/) {
  Lock lock;
  if (pHost == nullptr) return setError(cudaErrorInvalidValue);
  cudaError_t e = checkUnsafe("cudaHostAlloc");
  if (e != cudaSuccess) return e;
  void* p = allocateHost(size);
  if (p == nullptr)
    return fail(cudaErrorMemoryAllocation, "cudaHostAlloc(%zu): the host is out of memory", size);
  poison(p, size);
  registerAllocation(reinterpret_cast<uintptr_t>(p), size == 0 ? 1 : size, MemKind::kPinned);
  *pHost = p;
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** ptr, size_t size) {
  return cudaHostAlloc(ptr, size, 0);
}

cudaError_t cudaFreeHost(void* ptr) {
  Lock lock;
  if (ptr == nullptr) return cudaSuccess;
  cudaError_t e = checkUnsafe("cudaFreeHost");
  if (e != cudaSuccess) return e;
  const Allocation* a = findAllocation(ptr);
  if (a == nullptr || a->base != reinterpret_cast<uintptr_t>(ptr) || a->kind != MemKind::kPinned) {
    return fail(cudaErrorInvalidValue, "cudaFreeHost(%s): not a cudaHostAlloc allocation",
                hex(ptr).c_str());
  }
  runAll();
  unregisterAllocation(a->base);
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaHostRegister(void* ptr, size_t size, unsigned int /*flags*/) {
  Lock lock;
  if (ptr == nullptr || size == 0) return setError(cudaErrorInvalidValue);
  cudaError_t e = checkUnsafe("cudaHostRegister");
  if (e != cudaSuccess) return e;
  if (findAllocation(ptr) != nullptr) {
    return fail(cudaErrorHostMemoryAlreadyRegistered, "cudaHostRegister(%s): already registered",
                hex(ptr).c_str());
  }
  registerAllocation(reinterpret_cast<uintptr_t>(ptr), size, MemKind::kRegistered);
  return cudaSuccess;
}

cudaError_t cudaHostUnregister(void* ptr) {
  Lock lock;
  const Allocation* a = findAllocation(ptr);
  if (a == nullptr || a->kind != MemKind::kRegistered ||
      a->base != reinterpret_cast<uintptr_t>(ptr)) {
    return fail(cudaErrorHostMemoryNotRegistered, "cudaHostUnregister(%s): not registered",
                hex(ptr).c_str());
  }
  runAll();
  unregisterAllocation(a->base);
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* ptr) {
  Lock lock;
  if (attributes == nullptr) return setError(cudaErrorInvalidValue);
  std::memset(attributes, 0, sizeof(*attributes));
  const Allocation* a = findAllocation(ptr);
  if (a == nullptr) {
    attributes->type = cudaMemoryTypeUnregistered;
    attributes->device = -2;
    attributes->hostPointer = const_cast<void*>(ptr);
    return cudaSuccess;
  }
  attributes->device = 0;
  if (isDeviceKind(a->kind)) {
    attributes->type = cudaMemoryTypeDevice;
    attributes->devicePointer = const_cast<void*>(ptr);
  } else {
    attributes->type = cudaMemoryTypeHost;
    attributes->devicePointer = const_cast<void*>(ptr);
    attributes->hostPointer = const_cast<void*>(ptr);
  }
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  {
    Lock lock;
    cudaError_t e = checkUnsafe("cudaMemcpy");
    if (e != cudaSuccess) return e;
    if (isDeviceRange(dst, count) || isDeviceRange(src, count)) stats().host_waits++;
  }
  return copy2D(dst, count, src, count, count, 1, kind, nullptr, "cudaMemcpy", true);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  if (cudaError_t e = injectedFailure("cudaMemcpyAsync")) return e;
  return copy2D(dst, count, src, count, count, 1, kind, stream, "cudaMemcpyAsync", false);
}

cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind kind,
                              cudaStream_t stream) {
  return copy2D(dst, dpitch, src, spitch, width, height, kind, stream, "cudaMemcpy2DAsync", false);
}

cudaError_t cudaMemcpyPeerAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                                size_t count, cudaStream_t stream) {
  if (dstDevice != 0 || srcDevice != 0) {
    return fail(cudaErrorInvalidDevice, "cudaMemcpyPeerAsync(%d <- %d): one device", dstDevice,
                srcDevice);
  }
  return copy2D(dst, count, src, count, count, 1, cudaMemcpyDeviceToDevice, stream,
                "cudaMemcpyPeerAsync", false);
}

cudaError_t cudaMemset(void* devPtr, int value, size_t count) {
  return memset2D(devPtr, static_cast<unsigned>(value), 1, count, 1, count, nullptr, "cudaMemset");
}

cudaError_t cudaMemsetAsync(void* devPtr, int value, size_t count, cudaStream_t stream) {
  return memset2D(devPtr, static_cast<unsigned>(value), 1, count, 1, count, stream,
                  "cudaMemsetAsync");
}

}  // extern "C"

namespace standin {
// For the driver's cuMemsetD32Async and cuStreamWriteValue32.
cudaError_t memsetD32(void* p, unsigned value, size_t count, cudaStream_t stream,
                      const char* call) {
  return memset2D(p, value, 4, count, 1, count * 4, stream, call);
}
}  // namespace standin

extern "C" {

// ---- symbols (__device__ variables) ------------------------------------------------------------

void __cudaRegisterVar(void** /*fatCubinHandle*/, char* hostVar, char* /*deviceAddress*/,
                       const char* /*deviceName*/, int /*ext*/, size_t size, int /*constant*/,
                       int /*global*/) {
  Lock lock;
  void* view = nullptr;
  void* p = mapSymbol(size, &view);
  if (p == nullptr) return;
  std::memcpy(view, hostVar, size);  // the shadow holds the variable's initial value
  registerAllocation(reinterpret_cast<uintptr_t>(p), size == 0 ? 1 : size, MemKind::kSymbol,
                     reinterpret_cast<uintptr_t>(view));
  symbols()[hostVar] = {p, size};
}

cudaError_t cudaGetSymbolAddress(void** devPtr, const void* symbol) {
  Lock lock;
  auto it = symbols().find(symbol);
  if (it == symbols().end())
    return fail(cudaErrorInvalidSymbol, "cudaGetSymbolAddress: unknown symbol %s",
                hex(symbol).c_str());
  *devPtr = it->second.first;
  return cudaSuccess;
}

cudaError_t cudaMemcpyToSymbol(const void* symbol, const void* src, size_t count, size_t offset,
                               cudaMemcpyKind kind) {
  void* base = nullptr;
  {
    Lock lock;
    auto it = symbols().find(symbol);
    if (it == symbols().end())
      return fail(cudaErrorInvalidSymbol, "cudaMemcpyToSymbol: unknown symbol %s",
                  hex(symbol).c_str());
    if (offset + count > it->second.second)
      return fail(cudaErrorInvalidValue, "cudaMemcpyToSymbol: past the symbol's end");
    base = it->second.first;
  }
  return cudaMemcpy(static_cast<char*>(base) + offset, src, count,
                    kind == cudaMemcpyDefault ? cudaMemcpyDefault : kind);
}

// ---- the stream-ordered allocator ---------------------------------------------------------------

cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* memPool, int device) {
  if (device != 0)
    return fail(cudaErrorInvalidDevice, "cudaDeviceGetDefaultMemPool(%d): one device", device);
  *memPool = kDefaultPool;
  return cudaSuccess;
}

cudaError_t cudaMallocAsync(void** devPtr, size_t size, cudaStream_t hStream) {
  {
    Lock lock;
    CUstream_st* s = resolveStream(hStream, "cudaMallocAsync");
    if (s == nullptr)
      return fail(cudaErrorInvalidResourceHandle, "cudaMallocAsync: unknown stream");
    if (s->capture != nullptr) {
      return fail(cudaErrorNotSupported,
                  "cudaMallocAsync inside a stream capture needs memory-allocation nodes, which "
                  "the stand-in does not model");
    }
  }
  Lock lock;
  if (size == 0) {
    *devPtr = nullptr;
    return cudaSuccess;
  }
  const size_t rounded = (size + 511) & ~size_t(511);
  if (!reserveDeviceBytes(rounded)) {
    return fail(cudaErrorMemoryAllocation, "cudaMallocAsync(%zu): out of memory", size);
  }
  void* view = nullptr;
  void* p = mapDevice(rounded, &view);
  if (p == nullptr) {
    releaseDeviceBytes(rounded);
    return fail(cudaErrorMemoryAllocation, "cudaMallocAsync(%zu): the host is out of memory", size);
  }
  poison(view, rounded);
  registerAllocation(reinterpret_cast<uintptr_t>(p), rounded, MemKind::kDevice,
                     reinterpret_cast<uintptr_t>(view));
  asyncAllocations()[reinterpret_cast<uintptr_t>(p)] = rounded;
  size_t used = 0;
  for (auto& kv : asyncAllocations()) used += kv.second;
  if (used > async_high) async_high = used;
  stats().mallocs++;
  *devPtr = p;
  return cudaSuccess;
}

cudaError_t cudaFreeAsync(void* devPtr, cudaStream_t hStream) {
  Lock lock;
  if (devPtr == nullptr) return cudaSuccess;
  CUstream_st* s = resolveStream(hStream, "cudaFreeAsync");
  if (s == nullptr) return fail(cudaErrorInvalidResourceHandle, "cudaFreeAsync: unknown stream");
  if (s->capture != nullptr) {
    return fail(cudaErrorNotSupported, "cudaFreeAsync inside a stream capture is not modelled");
  }
  auto it = asyncAllocations().find(reinterpret_cast<uintptr_t>(devPtr));
  if (it == asyncAllocations().end())
    return fail(cudaErrorInvalidValue, "cudaFreeAsync(%s): not a cudaMallocAsync allocation",
                hex(devPtr).c_str());
  runStream(s);  // freed once the stream's earlier work is done
  const Allocation gone = *findAllocation(devPtr);
  releaseDeviceBytes(it->second);
  unregisterAllocation(it->first);
  asyncAllocations().erase(it);
  unmapDevice(gone);
  stats().frees++;
  return cudaSuccess;
}

cudaError_t cudaMemPoolTrimTo(cudaMemPool_t /*memPool*/, size_t /*minBytesToKeep*/) {
  return cudaSuccess;
}

cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t /*memPool*/, cudaMemPoolAttr attr, void* value) {
  Lock lock;
  if (attr == cudaMemPoolAttrReleaseThreshold) release_threshold = *static_cast<uint64_t*>(value);
  if (attr == cudaMemPoolAttrReservedMemHigh || attr == cudaMemPoolAttrUsedMemHigh) async_high = 0;
  return cudaSuccess;
}

cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t /*memPool*/, cudaMemPoolAttr attr, void* value) {
  Lock lock;
  size_t used = 0;
  for (auto& kv : asyncAllocations()) used += kv.second;
  switch (attr) {
    case cudaMemPoolAttrReleaseThreshold:
      *static_cast<uint64_t*>(value) = release_threshold;
      break;
    case cudaMemPoolAttrReservedMemCurrent:
    case cudaMemPoolAttrUsedMemCurrent:
      *static_cast<uint64_t*>(value) = used;
      break;
    case cudaMemPoolAttrReservedMemHigh:
    case cudaMemPoolAttrUsedMemHigh:
      *static_cast<uint64_t*>(value) = async_high;
      break;
    default:
      *static_cast<int*>(value) = 1;
      break;  // the reuse policies: all enabled
  }
  return cudaSuccess;
}

cudaError_t cudaMemPoolSetAccess(cudaMemPool_t /*memPool*/, const cudaMemAccessDesc* /*descList*/,
                                 size_t /*count*/) {
  return cudaSuccess;
}

cudaError_t cudaDeviceGetGraphMemAttribute(int device, cudaGraphMemAttributeType /*attr*/,
                                           void* value) {
  if (device != 0)
    return fail(cudaErrorInvalidDevice, "cudaDeviceGetGraphMemAttribute: one device");
  *static_cast<uint64_t*>(value) = 0;  // no memory-allocation nodes, so none in use
  return cudaSuccess;
}

cudaError_t cudaDeviceSetGraphMemAttribute(int device, cudaGraphMemAttributeType /*attr*/,
                                           void* /*value*/) {
  if (device != 0)
    return fail(cudaErrorInvalidDevice, "cudaDeviceSetGraphMemAttribute: one device");
  return cudaSuccess;
}

// ---- IPC: not modelled (one process, no driver) ------------------------------------------------

cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* /*handle*/, void* /*devPtr*/) {
  return fail(cudaErrorNotSupported, "cudaIpcGetMemHandle: IPC is not modelled");
}
cudaError_t cudaIpcOpenMemHandle(void** /*devPtr*/, cudaIpcMemHandle_t /*handle*/, unsigned int) {
  return fail(cudaErrorNotSupported, "cudaIpcOpenMemHandle: IPC is not modelled");
}
cudaError_t cudaIpcCloseMemHandle(void* /*devPtr*/) {
  return fail(cudaErrorNotSupported, "cudaIpcCloseMemHandle: IPC is not modelled");
}
cudaError_t cudaIpcGetEventHandle(cudaIpcEventHandle_t* /*handle*/, cudaEvent_t /*event*/) {
  return fail(cudaErrorNotSupported, "cudaIpcGetEventHandle: IPC is not modelled");
}
cudaError_t cudaIpcOpenEventHandle(cudaEvent_t* /*event*/, cudaIpcEventHandle_t /*handle*/) {
  return fail(cudaErrorNotSupported, "cudaIpcOpenEventHandle: IPC is not modelled");
}

__attribute__((visibility("default"))) void standin_fail_allocation(int64_t n, int64_t count) {
  Lock lock;
  fail_at = n;
  fail_count = count < 1 ? 1 : count;
}

__attribute__((visibility("default"))) int standin_is_device_memory(const void* p, size_t n) {
  Lock lock;
  return isDeviceRange(p, n == 0 ? 1 : n) ? 1 : 0;
}

}  // extern "C"
