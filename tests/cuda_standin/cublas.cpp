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
// nn.Linear records and replays like any other kernel; in the value mode the GEMMs that no aten
// op computes are computed here (Note [Stand-in cuBLAS values]). The matrix and vector
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

// ---- the value mode: GEMMs called outside the dispatcher --------------------------------------
// Note [Stand-in cuBLAS values]
// An aten GEMM is computed by the value engine at the op (Note [Stand-in values] in values.cpp).
// A GEMM called outside any engine op -- a raw cuBLAS call from an extension -- is computed here:
// C = alpha op(A) op(B) + beta C, column-major, per batch, in stream order (eagerly as stream
// work, in a capture attached to the routine's own node, so each replay computes it again),
// with alpha and beta read at the call (host pointer mode) or when it runs (device mode). Real
// and complex float and double, and in the Ex calls half and bfloat16 storage with float or
// double compute; anything else marks C unknown. If A, B (or C, with beta not 0) hold unknown
// bytes, so does C.

enum class Elem { kF32, kF64, kC32, kC64, kF16, kBF16, kNone };

size_t elemSize(Elem e) {
  switch (e) {
    case Elem::kF32:
      return 4;
    case Elem::kF64:
    case Elem::kC32:
      return 8;
    case Elem::kC64:
      return 16;
    case Elem::kF16:
    case Elem::kBF16:
      return 2;
    default:
      return 0;
  }
}

bool isComplex(Elem e) {
  return e == Elem::kC32 || e == Elem::kC64;
}

// cudaDataType -> element; kNone for what is not computed.
Elem elemOf(int data_type) {
  switch (data_type) {
    case 0:  // CUDA_R_32F
      return Elem::kF32;
    case 1:  // CUDA_R_64F
      return Elem::kF64;
    case 2:  // CUDA_R_16F
      return Elem::kF16;
    case 4:  // CUDA_C_32F
      return Elem::kC32;
    case 5:  // CUDA_C_64F
      return Elem::kC64;
    case 14:  // CUDA_R_16BF
      return Elem::kBF16;
    default:
      return Elem::kNone;
  }
}

float halfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal
      int e = -1;
      uint32_t m = man;
      do {
        e++;
        m <<= 1;
      } while ((m & 0x400) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t floatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  const int exp = static_cast<int>((x >> 23) & 0xFF) - 127 + 15;
  uint32_t man = x & 0x7FFFFF;
  if (((x >> 23) & 0xFF) == 0xFF) return static_cast<uint16_t>(sign | 0x7C00 | (man ? 0x200 : 0));
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7C00);
  if (exp <= 0) {
    if (exp < -10) return static_cast<uint16_t>(sign);
    man |= 0x800000;
    const int shift = 14 - exp;
    uint32_t h = man >> shift;
    const uint32_t rest = man & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (h & 1))) h++;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = sign | (static_cast<uint32_t>(exp) << 10) | (man >> 13);
  const uint32_t rest = man & 0x1FFF;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
  return static_cast<uint16_t>(h);
}

struct Cplx {
  double re = 0, im = 0;
};

Cplx load(const char* p, Elem e) {
  switch (e) {
    case Elem::kF32: {
      float v;
      std::memcpy(&v, p, 4);
      return {v, 0};
    }
    case Elem::kF64: {
      double v;
      std::memcpy(&v, p, 8);
      return {v, 0};
    }
    case Elem::kC32: {
      float v[2];
      std::memcpy(v, p, 8);
      return {v[0], v[1]};
    }
    case Elem::kC64: {
      double v[2];
      std::memcpy(v, p, 16);
      return {v[0], v[1]};
    }
    case Elem::kF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return {halfToFloat(h), 0};
    }
    case Elem::kBF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      float v;
      std::memcpy(&v, &bits, 4);
      return {v, 0};
    }
    default:
      return {};
  }
}

void store(char* p, Elem e, Cplx v) {
  switch (e) {
    case Elem::kF32: {
      const float f = static_cast<float>(v.re);
      std::memcpy(p, &f, 4);
      return;
    }
    case Elem::kF64:
      std::memcpy(p, &v.re, 8);
      return;
    case Elem::kC32: {
      const float f[2] = {static_cast<float>(v.re), static_cast<float>(v.im)};
      std::memcpy(p, f, 8);
      return;
    }
    case Elem::kC64: {
      const double d[2] = {v.re, v.im};
      std::memcpy(p, d, 16);
      return;
    }
    case Elem::kF16: {
      const uint16_t h = floatToHalf(static_cast<float>(v.re));
      std::memcpy(p, &h, 2);
      return;
    }
    case Elem::kBF16: {
      const float f = static_cast<float>(v.re);
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      bits += 0x7FFF + ((bits >> 16) & 1);  // round to nearest even
      const uint16_t h = static_cast<uint16_t>(bits >> 16);
      std::memcpy(p, &h, 2);
      return;
    }
    default:
      return;
  }
}

struct Gemm {
  int ta = 0, tb = 0;  // CUBLAS_OP_N 0, T 1, C 2
  int m = 0, n = 0, k = 0, batch = 1;
  Elem ab = Elem::kNone, c = Elem::kNone, scalar = Elem::kNone;
  const char* A = nullptr;
  const char* B = nullptr;
  char* C = nullptr;
  long long lda = 0, ldb = 0, ldc = 0, sa = 0, sb = 0, sc = 0;  // strides in elements
  Cplx alpha, beta;
  const void* alpha_dev = nullptr;  // device pointer mode: read when it runs
  const void* beta_dev = nullptr;
  bool persistent = false;  // captured: freed with the graph (its user object)
};

// The bytes a column-major rows x cols matrix with leading dimension ld spans, over the batch.
size_t span(int rows, int cols, long long ld, long long stride, int batch, Elem e) {
  if (rows <= 0 || cols <= 0 || batch <= 0) return 0;
  const long long last = (rows - 1) + (cols - 1) * ld + (batch - 1) * stride;
  return static_cast<size_t>(last + 1) * elemSize(e);
}

void CUDART_CB runGemm(void* p) {
  auto* g = static_cast<Gemm*>(p);
  const int ar = g->ta == 0 ? g->m : g->k, ac = g->ta == 0 ? g->k : g->m;
  const int br = g->tb == 0 ? g->k : g->n, bc = g->tb == 0 ? g->n : g->k;
  const size_t a_n = span(ar, ac, g->lda, g->sa, g->batch, g->ab);
  const size_t b_n = span(br, bc, g->ldb, g->sb, g->batch, g->ab);
  const size_t c_n = span(g->m, g->n, g->ldc, g->sc, g->batch, g->c);
  Cplx alpha = g->alpha, beta = g->beta;
  bool ok = c_n > 0;
  if (ok && g->alpha_dev != nullptr) {
    const void* av = standin_host_view(g->alpha_dev, elemSize(g->scalar));
    const void* bv = standin_host_view(g->beta_dev, elemSize(g->scalar));
    ok = av != nullptr && bv != nullptr;
    if (ok) {
      alpha = load(static_cast<const char*>(av), g->scalar);
      beta = load(static_cast<const char*>(bv), g->scalar);
    }
  }
  const char* A = ok && a_n ? static_cast<const char*>(standin_host_view(g->A, a_n)) : nullptr;
  const char* B = ok && b_n ? static_cast<const char*>(standin_host_view(g->B, b_n)) : nullptr;
  char* C = ok ? static_cast<char*>(standin_host_view(g->C, c_n)) : nullptr;
  ok = ok && C != nullptr && (g->k == 0 || (A != nullptr && B != nullptr));
  if (!ok) {
    if (c_n > 0) standin_values_mark(g->C, c_n, 1);
  } else {
    const bool reads_c = beta.re != 0 || beta.im != 0;
    const bool unknown = (a_n && standin_values_unknown(g->A, a_n)) ||
                         (b_n && standin_values_unknown(g->B, b_n)) ||
                         (reads_c && standin_values_unknown(g->C, c_n));
    const size_t ea = elemSize(g->ab), ec = elemSize(g->c);
    for (int b = 0; b < g->batch; ++b) {
      for (int j = 0; j < g->n; ++j) {
        for (int i = 0; i < g->m; ++i) {
          Cplx acc;
          for (int l = 0; l < g->k; ++l) {
            // op(A)[i, l] and op(B)[l, j], column-major.
            const long long ai = g->ta == 0 ? i + l * g->lda : l + i * g->lda;
            const long long bi = g->tb == 0 ? l + j * g->ldb : j + l * g->ldb;
            Cplx x = load(A + (b * g->sa + ai) * ea, g->ab);
            Cplx y = load(B + (b * g->sb + bi) * ea, g->ab);
            if (g->ta == 2) x.im = -x.im;
            if (g->tb == 2) y.im = -y.im;
            acc.re += x.re * y.re - x.im * y.im;
            acc.im += x.re * y.im + x.im * y.re;
          }
          char* cp = C + (b * g->sc + i + j * g->ldc) * ec;
          const Cplx old = reads_c ? load(cp, g->c) : Cplx{};
          Cplx r;
          r.re = alpha.re * acc.re - alpha.im * acc.im + beta.re * old.re - beta.im * old.im;
          r.im = alpha.re * acc.im + alpha.im * acc.re + beta.re * old.im + beta.im * old.re;
          store(cp, g->c, r);
        }
      }
    }
    standin_values_mark(g->C, c_n, unknown ? 1 : 0);
  }
  if (!g->persistent) delete g;
}

void CUDART_CB freeGemm(void* p) {
  delete static_cast<Gemm*>(p);
}

// A GEMM routine's submission: computed (Note [Stand-in cuBLAS values]) when the value mode is on
// and no engine op computes it already; otherwise a kernel that writes C (marked unknown).
Status gemm(const char* routine, Handle* handle, Gemm* g, const void* alpha, const void* beta) {
  if (!standin_values_active() || standin_values_computing() || g->ab == Elem::kNone ||
      g->c == Elem::kNone || g->scalar == Elem::kNone) {
    void* out = g->C;
    delete g;
    return kernel(routine, handle->stream, out);
  }
  if (handle->pointer_mode == 1) {
    g->alpha_dev = alpha;
    g->beta_dev = beta;
  } else {
    g->alpha = load(static_cast<const char*>(alpha), g->scalar);
    g->beta = load(static_cast<const char*>(beta), g->scalar);
  }
  standin_values_enter(routine);  // its own node, not an uncomputed launch
  const Status st = kernel(routine, handle->stream);
  standin_values_exit();
  if (st != kSuccess) {
    delete g;
    return st;
  }
  if (standin_submit_host_work(handle->stream, runGemm, g, freeGemm, &g->persistent) !=
      cudaSuccess) {
    if (!g->persistent) delete g;
    return kInvalidValue;
  }
  return kSuccess;
}

Gemm* newGemm(int ta, int tb, int m, int n, int k, Elem ab, Elem c, Elem scalar, const void* A,
              int lda, long long sa, const void* B, int ldb, long long sb, void* C, int ldc,
              long long sc, int batch) {
  auto* g = new Gemm();
  g->ta = ta;
  g->tb = tb;
  g->m = m;
  g->n = n;
  g->k = k;
  g->ab = ab;
  g->c = c;
  g->scalar = scalar;
  g->A = static_cast<const char*>(A);
  g->B = static_cast<const char*>(B);
  g->C = static_cast<char*>(C);
  g->lda = lda;
  g->ldb = ldb;
  g->ldc = ldc;
  g->sa = sa;
  g->sb = sb;
  g->sc = sc;
  g->batch = batch;
  return g;
}

// cublasComputeType_t -> the scalars' element (alpha, beta): 64F, 32F and its fast variants.
Elem scalarOf(int compute, Elem c) {
  switch (compute) {
    case 70:  // CUBLAS_COMPUTE_64F
    case 71:  // CUBLAS_COMPUTE_64F_PEDANTIC
      return isComplex(c) ? Elem::kC64 : Elem::kF64;
    case 68:  // CUBLAS_COMPUTE_32F
    case 69:  // CUBLAS_COMPUTE_32F_PEDANTIC
    case 74:  // CUBLAS_COMPUTE_32F_FAST_16F
    case 75:  // CUBLAS_COMPUTE_32F_FAST_16BF
    case 77:  // CUBLAS_COMPUTE_32F_FAST_TF32
      return isComplex(c) ? Elem::kC32 : Elem::kF32;
    default:
      return Elem::kNone;
  }
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

// The GEMMs are computed in the value mode (Note [Stand-in cuBLAS values]).
#define GEMM(name, E)                                                                           \
  EXPORT Status name(Handle* handle, int ta, int tb, int m, int n, int k, const void* alpha,    \
                     const void* A, int lda, const void* B, int ldb, const void* beta, void* C, \
                     int ldc) {                                                                 \
    if (!valid(handle)) return kNotInitialized;                                                 \
    return gemm(#name, handle,                                                                  \
                newGemm(ta, tb, m, n, k, E, E, E, A, lda, 0, B, ldb, 0, C, ldc, 0, 1), alpha,   \
                beta);                                                                          \
  }
#define GEMM_STRIDED(name, E)                                                                    \
  EXPORT Status name(Handle* handle, int ta, int tb, int m, int n, int k, const void* alpha,     \
                     const void* A, int lda, long long sa, const void* B, int ldb, long long sb, \
                     const void* beta, void* C, int ldc, long long sc, int batch) {              \
    if (!valid(handle)) return kNotInitialized;                                                  \
    return gemm(#name, handle,                                                                   \
                newGemm(ta, tb, m, n, k, E, E, E, A, lda, sa, B, ldb, sb, C, ldc, sc, batch),    \
                alpha, beta);                                                                    \
  }
EXPORT Status cublasGemmEx(Handle* handle, int ta, int tb, int m, int n, int k, const void* alpha,
                           const void* A, int atype, int lda, const void* B, int btype, int ldb,
                           const void* beta, void* C, int ctype, int ldc, int compute, int) {
  if (!valid(handle)) return kNotInitialized;
  const Elem ab = atype == btype ? elemOf(atype) : Elem::kNone, c = elemOf(ctype);
  return gemm(
      "cublasGemmEx", handle,
      newGemm(ta, tb, m, n, k, ab, c, scalarOf(compute, c), A, lda, 0, B, ldb, 0, C, ldc, 0, 1),
      alpha, beta);
}
EXPORT Status cublasGemmStridedBatchedEx(Handle* handle, int ta, int tb, int m, int n, int k,
                                         const void* alpha, const void* A, int atype, int lda,
                                         long long sa, const void* B, int btype, int ldb,
                                         long long sb, const void* beta, void* C, int ctype,
                                         int ldc, long long sc, int batch, int compute, int) {
  if (!valid(handle)) return kNotInitialized;
  const Elem ab = atype == btype ? elemOf(atype) : Elem::kNone, c = elemOf(ctype);
  return gemm("cublasGemmStridedBatchedEx", handle,
              newGemm(ta, tb, m, n, k, ab, c, scalarOf(compute, c), A, lda, sa, B, ldb, sb, C, ldc,
                      sc, batch),
              alpha, beta);
}

// clang-format off
GEMM(cublasSgemm_v2, Elem::kF32) GEMM(cublasDgemm_v2, Elem::kF64)
GEMM(cublasCgemm_v2, Elem::kC32) GEMM(cublasZgemm_v2, Elem::kC64)
GEMM_STRIDED(cublasSgemmStridedBatched, Elem::kF32) GEMM_STRIDED(cublasDgemmStridedBatched, Elem::kF64)
GEMM_STRIDED(cublasCgemmStridedBatched, Elem::kC32) GEMM_STRIDED(cublasZgemmStridedBatched, Elem::kC64)
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
