// cuBLAS (libcublas.so.13) and, built with -DSTANDIN_CUBLASLT, cuBLASLt (libcublasLt.so.13).

#include "standin_api.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

// Note [Stand-in cuBLAS]
// The real cuBLAS carries its own static CUDA runtime and reaches the driver behind the
// stand-in's back, so it is replaced too (same SONAMEs, preloaded). A handle keeps its stream,
// workspace, math mode and pointer mode; cublasSetWorkspace checks that the workspace is live
// device memory of the size given (so a workspace freed under a handle, or one made inside a
// graph's pool and freed with it, is caught). Every BLAS routine torch calls -- GEMMs, batched
// and strided GEMMs, GEMV, dot products, the batched factorisations -- and cublasLtMatmul are
// submitted to the handle's (or the call's) stream as a kernel named after the routine, so an
// nn.Linear records and replays like any other kernel, with no values. The matrix and vector
// copies (cublasSet/GetMatrixAsync, ...) are real 2-D copies. cublasLtMatmulAlgoGetHeuristic
// offers one algorithm that needs no workspace. A routine not listed here is absent, and its
// first call ends the process naming it (Note [Unmodelled calls] in state.cpp). The ABI types
// are declared here rather than taken from cublas_api.h (which the CUDA toolkit on a machine
// without cuBLAS lacks): handles are pointers, statuses and enums are ints, and the one struct
// whose layout matters, the heuristic result, is checked against its documented size.

namespace {

using Status = int;
constexpr Status kSuccess = 0;
constexpr Status kNotInitialized = 1;
constexpr Status kInvalidValue = 7;

struct Handle {
  cudaStream_t stream = nullptr;
  void* workspace = nullptr;
  size_t workspace_size = 0;
  int math_mode = 0;
  int pointer_mode = 0;
  int sm_count_target = 0;
  uint32_t magic = 0x57A4D1A5;
};

bool valid(const Handle* h) {
  return h != nullptr && h->magic == 0x57A4D1A5;
}

// `out`: the device matrix the routine writes, if known: in the value mode, a call that no engine
// op computes (cuBLAS called outside the dispatcher) marks it unknown (Note [Stand-in values]).
Status kernel(const char* routine, cudaStream_t stream, void* out = nullptr) {
  const int e = standin_launch_writes(routine, stream, 1, 128, out);
  return e == 0 ? kSuccess : kInvalidValue;
}

void report(const char* what) {
  std::fprintf(stderr, "[cuda stand-in] cuBLAS: %s\n", what);
}

}  // namespace

#define EXPORT extern "C" __attribute__((visibility("default")))

#ifndef STANDIN_CUBLASLT

// ---- handles --------------------------------------------------------------------------------

EXPORT Status cublasCreate_v2(Handle** handle) {
  if (handle == nullptr) return kInvalidValue;
  *handle = new Handle();
  return kSuccess;
}

EXPORT Status cublasDestroy_v2(Handle* handle) {
  if (!valid(handle)) return kNotInitialized;
  handle->magic = 0;
  delete handle;
  return kSuccess;
}

EXPORT Status cublasSetStream_v2(Handle* handle, cudaStream_t stream) {
  if (!valid(handle)) return kNotInitialized;
  handle->stream = stream;
  return kSuccess;
}

EXPORT Status cublasGetStream_v2(Handle* handle, cudaStream_t* stream) {
  if (!valid(handle) || stream == nullptr) return kNotInitialized;
  *stream = handle->stream;
  return kSuccess;
}

EXPORT Status cublasSetWorkspace_v2(Handle* handle, void* workspace, size_t size) {
  if (!valid(handle)) return kNotInitialized;
  if (size > 0 && !standin_is_device_memory(workspace, size)) {
    report("cublasSetWorkspace: the workspace is not live device memory of that size");
    return kInvalidValue;
  }
  handle->workspace = workspace;
  handle->workspace_size = size;
  return kSuccess;
}

EXPORT Status cublasSetMathMode(Handle* handle, int mode) {
  if (!valid(handle)) return kNotInitialized;
  handle->math_mode = mode;
  return kSuccess;
}

EXPORT Status cublasGetMathMode(Handle* handle, int* mode) {
  if (!valid(handle) || mode == nullptr) return kNotInitialized;
  *mode = handle->math_mode;
  return kSuccess;
}

EXPORT Status cublasSetPointerMode_v2(Handle* handle, int mode) {
  if (!valid(handle)) return kNotInitialized;
  handle->pointer_mode = mode;
  return kSuccess;
}

EXPORT Status cublasGetPointerMode_v2(Handle* handle, int* mode) {
  if (!valid(handle) || mode == nullptr) return kNotInitialized;
  *mode = handle->pointer_mode;
  return kSuccess;
}

EXPORT Status cublasSetSmCountTarget(Handle* handle, int count) {
  if (!valid(handle)) return kNotInitialized;
  handle->sm_count_target = count;
  return kSuccess;
}

EXPORT Status cublasGetVersion_v2(Handle* /*handle*/, int* version) {
  if (version == nullptr) return kInvalidValue;
  *version = 130000;
  return kSuccess;
}

// ---- copies ---------------------------------------------------------------------------------

EXPORT Status cublasSetMatrixAsync(int rows, int cols, int elemSize, const void* A, int lda,
                                   void* B, int ldb, cudaStream_t stream) {
  const cudaError_t e =
      cudaMemcpy2DAsync(B, size_t(ldb) * elemSize, A, size_t(lda) * elemSize,
                        size_t(rows) * elemSize, cols, cudaMemcpyHostToDevice, stream);
  return e == cudaSuccess ? kSuccess : kInvalidValue;
}

EXPORT Status cublasGetMatrixAsync(int rows, int cols, int elemSize, const void* A, int lda,
                                   void* B, int ldb, cudaStream_t stream) {
  const cudaError_t e =
      cudaMemcpy2DAsync(B, size_t(ldb) * elemSize, A, size_t(lda) * elemSize,
                        size_t(rows) * elemSize, cols, cudaMemcpyDeviceToHost, stream);
  return e == cudaSuccess ? kSuccess : kInvalidValue;
}

EXPORT Status cublasSetVectorAsync(int n, int elemSize, const void* x, int incx, void* y, int incy,
                                   cudaStream_t stream) {
  const cudaError_t e = cudaMemcpy2DAsync(y, size_t(incy) * elemSize, x, size_t(incx) * elemSize,
                                          elemSize, n, cudaMemcpyHostToDevice, stream);
  return e == cudaSuccess ? kSuccess : kInvalidValue;
}

EXPORT Status cublasGetVectorAsync(int n, int elemSize, const void* x, int incx, void* y, int incy,
                                   cudaStream_t stream) {
  const cudaError_t e = cudaMemcpy2DAsync(y, size_t(incy) * elemSize, x, size_t(incx) * elemSize,
                                          elemSize, n, cudaMemcpyDeviceToHost, stream);
  return e == cudaSuccess ? kSuccess : kInvalidValue;
}

// ---- BLAS routines: kernels on the handle's stream ------------------------------------------
// Each takes the handle first; the C calling convention lets the definition ignore the rest.

#define ROUTINE(name)                           \
  EXPORT Status name(Handle* handle) {          \
    if (!valid(handle)) return kNotInitialized; \
    return kernel(#name, handle->stream);       \
  }

// The GEMMs name the matrix they write (C), for the value mode.
#define GEMM(name)                                                                           \
  EXPORT Status name(Handle* handle, int, int, int, int, int, const void*, const void*, int, \
                     const void*, int, const void*, void* C, int) {                          \
    if (!valid(handle)) return kNotInitialized;                                              \
    return kernel(#name, handle->stream, C);                                                 \
  }
#define GEMM_STRIDED(name)                                                                         \
  EXPORT Status name(Handle* handle, int, int, int, int, int, const void*, const void*, int,       \
                     long long, const void*, int, long long, const void*, void* C, int, long long, \
                     int) {                                                                        \
    if (!valid(handle)) return kNotInitialized;                                                    \
    return kernel(#name, handle->stream, C);                                                       \
  }
EXPORT Status cublasGemmEx(Handle* handle, int, int, int, int, int, const void*, const void*, int,
                           int, const void*, int, int, const void*, void* C, int, int, int, int) {
  if (!valid(handle)) return kNotInitialized;
  return kernel("cublasGemmEx", handle->stream, C);
}
EXPORT Status cublasGemmStridedBatchedEx(Handle* handle, int, int, int, int, int, const void*,
                                         const void*, int, int, long long, const void*, int, int,
                                         long long, const void*, void* C, int, int, long long, int,
                                         int, int) {
  if (!valid(handle)) return kNotInitialized;
  return kernel("cublasGemmStridedBatchedEx", handle->stream, C);
}

// clang-format off
GEMM(cublasSgemm_v2) GEMM(cublasDgemm_v2) GEMM(cublasCgemm_v2) GEMM(cublasZgemm_v2)
GEMM_STRIDED(cublasSgemmStridedBatched) GEMM_STRIDED(cublasDgemmStridedBatched)
GEMM_STRIDED(cublasCgemmStridedBatched) GEMM_STRIDED(cublasZgemmStridedBatched)
#define FOR_EACH_TYPED(X, S, D, C, Z) X(S) X(D) X(C) X(Z)
#define TYPED(stem) FOR_EACH_TYPED(ROUTINE, cublasS##stem, cublasD##stem, cublasC##stem, cublasZ##stem)
TYPED(gemmBatched) TYPED(gemv_v2)
TYPED(axpy_v2) TYPED(copy_v2) TYPED(scal_v2) TYPED(swap_v2) TYPED(rot_v2) TYPED(rotg_v2)
TYPED(symm_v2) TYPED(symv_v2) TYPED(syr_v2) TYPED(syr2_v2) TYPED(syr2k_v2) TYPED(syrk_v2)
TYPED(trmm_v2) TYPED(trmv_v2) TYPED(trsm_v2) TYPED(trsmBatched) TYPED(trsv_v2)
TYPED(gelsBatched) TYPED(geqrfBatched) TYPED(getrfBatched) TYPED(getrsBatched)
ROUTINE(cublasSdot_v2) ROUTINE(cublasDdot_v2) ROUTINE(cublasCdotc_v2) ROUTINE(cublasCdotu_v2)
ROUTINE(cublasZdotc_v2) ROUTINE(cublasZdotu_v2) ROUTINE(cublasDotEx)
ROUTINE(cublasSger_v2) ROUTINE(cublasDger_v2) ROUTINE(cublasCgerc_v2) ROUTINE(cublasCgeru_v2)
ROUTINE(cublasZgerc_v2) ROUTINE(cublasZgeru_v2)
ROUTINE(cublasSasum_v2) ROUTINE(cublasDasum_v2) ROUTINE(cublasScasum_v2) ROUTINE(cublasDzasum_v2)
ROUTINE(cublasSnrm2_v2) ROUTINE(cublasDnrm2_v2) ROUTINE(cublasScnrm2_v2) ROUTINE(cublasDznrm2_v2)
ROUTINE(cublasIsamax_v2) ROUTINE(cublasIdamax_v2) ROUTINE(cublasIcamax_v2) ROUTINE(cublasIzamax_v2)
ROUTINE(cublasIsamin_v2) ROUTINE(cublasIdamin_v2) ROUTINE(cublasIcamin_v2) ROUTINE(cublasIzamin_v2)
ROUTINE(cublasSrotm_v2) ROUTINE(cublasDrotm_v2) ROUTINE(cublasSrotmg_v2) ROUTINE(cublasDrotmg_v2)
ROUTINE(cublasCsrot_v2) ROUTINE(cublasZdrot_v2) ROUTINE(cublasCsscal_v2) ROUTINE(cublasZdscal_v2)
ROUTINE(cublasChemm_v2) ROUTINE(cublasZhemm_v2) ROUTINE(cublasChemv_v2) ROUTINE(cublasZhemv_v2)
ROUTINE(cublasCher_v2) ROUTINE(cublasZher_v2) ROUTINE(cublasCher2_v2) ROUTINE(cublasZher2_v2)
ROUTINE(cublasCher2k_v2) ROUTINE(cublasZher2k_v2) ROUTINE(cublasCherk_v2) ROUTINE(cublasZherk_v2)
ROUTINE(cublasSgemmEx)
ROUTINE(cublasGemmBatchedEx)
// clang-format on

#else  // STANDIN_CUBLASLT

// ---- cuBLASLt -------------------------------------------------------------------------------

namespace {
struct LtAlgo {
  uint64_t data[8];
};
struct LtHeuristicResult {
  LtAlgo algo;
  size_t workspaceSize;
  Status state;
  float wavesCount;
  int reserved[4];
};
static_assert(sizeof(LtHeuristicResult) == 96, "cublasLtMatmulHeuristicResult_t is 96 bytes");
struct Opaque {
  uint64_t data[64];
};
}  // namespace

EXPORT size_t cublasLtGetVersion(void) {
  return 130000;
}

#define LT_CREATE(name)                       \
  EXPORT Status name(Opaque** out) {          \
    if (out == nullptr) return kInvalidValue; \
    *out = new Opaque();                      \
    return kSuccess;                          \
  }
#define LT_DESTROY(name)          \
  EXPORT Status name(Opaque* d) { \
    delete d;                     \
    return kSuccess;              \
  }
#define LT_NOOP(name)                               \
  EXPORT Status name(void* d) {                     \
    return d == nullptr ? kInvalidValue : kSuccess; \
  }
LT_CREATE(cublasLtMatmulDescCreate)
LT_CREATE(cublasLtMatrixLayoutCreate)
LT_CREATE(cublasLtMatmulPreferenceCreate)
LT_DESTROY(cublasLtMatmulDescDestroy)
LT_DESTROY(cublasLtMatrixLayoutDestroy)
LT_DESTROY(cublasLtMatmulPreferenceDestroy)
LT_NOOP(cublasLtMatmulDescSetAttribute)
LT_NOOP(cublasLtMatrixLayoutSetAttribute)
LT_NOOP(cublasLtMatmulPreferenceSetAttribute)
LT_NOOP(cublasLtMatmulAlgoConfigSetAttribute)

EXPORT Status cublasLtMatmulAlgoConfigGetAttribute(const LtAlgo* algo, int /*attr*/, void* buf,
                                                   size_t size, size_t* written) {
  if (algo == nullptr) return kInvalidValue;
  if (buf != nullptr) std::memset(buf, 0, size);
  if (written != nullptr) *written = size;
  return kSuccess;
}

EXPORT Status cublasLtMatmulAlgoInit(void* /*handle*/, int, int, int, int, int, int algoId,
                                     LtAlgo* algo) {
  if (algo == nullptr) return kInvalidValue;
  std::memset(algo, 0, sizeof(*algo));
  algo->data[0] = static_cast<uint64_t>(algoId);
  return kSuccess;
}

EXPORT Status cublasLtMatmulAlgoCheck(void* /*handle*/, void*, void*, void*, void*, void*,
                                      const LtAlgo* algo, LtHeuristicResult* result) {
  if (algo == nullptr || result == nullptr) return kInvalidValue;
  std::memset(result, 0, sizeof(*result));
  result->algo = *algo;
  result->state = kSuccess;
  result->wavesCount = 1.0f;
  return kSuccess;
}

EXPORT Status cublasLtMatmulAlgoGetHeuristic(void* handle, void* /*desc*/, void*, void*, void*,
                                             void*, void* /*preference*/, int requested,
                                             LtHeuristicResult* results, int* returned) {
  if (handle == nullptr || results == nullptr || returned == nullptr || requested < 1) {
    return kInvalidValue;
  }
  std::memset(results, 0, sizeof(LtHeuristicResult));
  results[0].state = kSuccess;
  results[0].wavesCount = 1.0f;
  *returned = 1;
  return kSuccess;
}

EXPORT Status cublasLtMatmul(void* handle, void* desc, const void* /*alpha*/, const void* /*A*/,
                             void* /*Adesc*/, const void* /*B*/, void* /*Bdesc*/,
                             const void* /*beta*/, const void* /*C*/, void* /*Cdesc*/, void* D,
                             void* /*Ddesc*/, const LtAlgo* /*algo*/, void* workspace,
                             size_t workspaceSize, cudaStream_t stream) {
  if (handle == nullptr || desc == nullptr) return kNotInitialized;
  if (workspaceSize > 0 && !standin_is_device_memory(workspace, workspaceSize)) {
    report("cublasLtMatmul: the workspace is not live device memory of that size");
    return kInvalidValue;
  }
  return kernel("cublasLtMatmul", stream, D);
}

#endif  // STANDIN_CUBLASLT
