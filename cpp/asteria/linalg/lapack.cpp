#include "asteria/linalg/lapack.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "asteria/common/errors.h"
#include "asteria/linalg/detail.h"
#include "asteria/linalg/simd.h"

// The Fortran interface OpenBLAS exports (LP64: 32-bit integers). gfortran passes the length of
// every CHARACTER argument as a trailing hidden size_t; the LAPACK routines are compiled Fortran,
// so omitting those lengths is undefined behaviour even though single-letter options mostly work.
extern "C" {
void ssyevd_(const char* jobz, const char* uplo, const int* n, float* a, const int* lda, float* w, float* work,
             const int* lwork, int* iwork, const int* liwork, int* info, std::size_t jobz_len,
             std::size_t uplo_len);
void dsyevd_(const char* jobz, const char* uplo, const int* n, double* a, const int* lda, double* w, double* work,
             const int* lwork, int* iwork, const int* liwork, int* info, std::size_t jobz_len,
             std::size_t uplo_len);
void ssyrk_(const char* uplo, const char* trans, const int* n, const int* k, const float* alpha, const float* a,
            const int* lda, const float* beta, float* c, const int* ldc, std::size_t uplo_len,
            std::size_t trans_len);
void dsyrk_(const char* uplo, const char* trans, const int* n, const int* k, const double* alpha, const double* a,
            const int* lda, const double* beta, double* c, const int* ldc, std::size_t uplo_len,
            std::size_t trans_len);
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc, std::size_t transa_len, std::size_t transb_len);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc, std::size_t transa_len, std::size_t transb_len);
void ssyr2k_(const char* uplo, const char* trans, const int* n, const int* k, const float* alpha, const float* a,
             const int* lda, const float* b, const int* ldb, const float* beta, float* c, const int* ldc,
             std::size_t uplo_len, std::size_t trans_len);
void dsyr2k_(const char* uplo, const char* trans, const int* n, const int* k, const double* alpha, const double* a,
             const int* lda, const double* b, const int* ldb, const double* beta, double* c, const int* ldc,
             std::size_t uplo_len, std::size_t trans_len);
void slarfg_(const int* n, float* alpha, float* x, const int* incx, float* tau);
void dlarfg_(const int* n, double* alpha, double* x, const int* incx, double* tau);
void ssytd2_(const char* uplo, const int* n, float* a, const int* lda, float* d, float* e, float* tau, int* info,
             std::size_t uplo_len);
void dsytd2_(const char* uplo, const int* n, double* a, const int* lda, double* d, double* e, double* tau, int* info,
             std::size_t uplo_len);
void sstedc_(const char* compz, const int* n, float* d, float* e, float* z, const int* ldz, float* work,
             const int* lwork, int* iwork, const int* liwork, int* info, std::size_t compz_len);
void dstedc_(const char* compz, const int* n, double* d, double* e, double* z, const int* ldz, double* work,
             const int* lwork, int* iwork, const int* liwork, int* info, std::size_t compz_len);
}

namespace asteria::linalg {
namespace {

using detail::grow;
using namespace simd;

constexpr std::size_t kOptionLen = 1;  // every option we pass is a single letter

template <typename T>
constexpr char prefix() {
  return sizeof(T) == sizeof(float) ? 's' : 'd';
}

// "[syevd] n=-1: must be >= 0"
void require(bool ok, const char* routine, const char* what, long long value, const std::string& rule) {
  if (!ok) {
    throw InvalidArgument(std::string("[") + routine + "] Invalid " + what + "=" + std::to_string(value) +
                          ": must be " + rule);
  }
}

void require_leading_dim(const char* routine, const char* what, int ld, int rows) {
  const int min_ld = std::max(1, rows);
  require(ld >= min_ld, routine, what, ld, ">= max(1, " + std::to_string(rows) + ")");
}

// "[syevd] ssyevd failed, info=3 (n=1024)": the shim function, then the LAPACK routine.
template <typename T>
void check_info(const char* function, const char* routine, int info, int n) {
  if (info != 0) {
    throw NumericalError(std::string("[") + function + "] " + prefix<T>() + routine + " failed, info=" +
                         std::to_string(info) + " (n=" + std::to_string(n) + ")");
  }
}

// LAPACK reports the optimal workspace as a floating-point number; float loses integers above
// 2^24, so the reported size is rounded up rather than truncated.
template <typename T>
std::size_t queried_size(T reported) {
  return static_cast<std::size_t>(static_cast<double>(reported) * (1.0 + 1e-6)) + 1;
}

void call_syevd(const int* n, float* a, const int* lda, float* w, float* work, const int* lwork, int* iwork,
                const int* liwork, int* info) {
  ssyevd_("V", "L", n, a, lda, w, work, lwork, iwork, liwork, info, kOptionLen, kOptionLen);
}
void call_syevd(const int* n, double* a, const int* lda, double* w, double* work, const int* lwork, int* iwork,
                const int* liwork, int* info) {
  dsyevd_("V", "L", n, a, lda, w, work, lwork, iwork, liwork, info, kOptionLen, kOptionLen);
}

void call_syrk(const int* n, const int* k, const float* alpha, const float* a, const int* lda, const float* beta,
               float* c, const int* ldc) {
  ssyrk_("L", "N", n, k, alpha, a, lda, beta, c, ldc, kOptionLen, kOptionLen);
}
void call_syrk(const int* n, const int* k, const double* alpha, const double* a, const int* lda, const double* beta,
               double* c, const int* ldc) {
  dsyrk_("L", "N", n, k, alpha, a, lda, beta, c, ldc, kOptionLen, kOptionLen);
}

void call_gemm(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
               const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
               const int* ldc) {
  sgemm_(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, kOptionLen, kOptionLen);
}
void call_gemm(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
               const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
               const int* ldc) {
  dgemm_(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, kOptionLen, kOptionLen);
}

void call_syr2k(const int* n, const int* k, const float* alpha, const float* a, const int* lda, const float* b,
                const int* ldb, const float* beta, float* c, const int* ldc) {
  ssyr2k_("L", "N", n, k, alpha, a, lda, b, ldb, beta, c, ldc, kOptionLen, kOptionLen);
}
void call_syr2k(const int* n, const int* k, const double* alpha, const double* a, const int* lda, const double* b,
                const int* ldb, const double* beta, double* c, const int* ldc) {
  dsyr2k_("L", "N", n, k, alpha, a, lda, b, ldb, beta, c, ldc, kOptionLen, kOptionLen);
}

void call_larfg(const int* n, float* alpha, float* x, float* tau) {
  const int incx = 1;
  slarfg_(n, alpha, x, &incx, tau);
}
void call_larfg(const int* n, double* alpha, double* x, double* tau) {
  const int incx = 1;
  dlarfg_(n, alpha, x, &incx, tau);
}

void call_sytd2(const int* n, float* a, const int* lda, float* d, float* e, float* tau, int* info) {
  ssytd2_("L", n, a, lda, d, e, tau, info, kOptionLen);
}
void call_sytd2(const int* n, double* a, const int* lda, double* d, double* e, double* tau, int* info) {
  dsytd2_("L", n, a, lda, d, e, tau, info, kOptionLen);
}

void call_stedc(const int* n, float* d, float* e, float* z, const int* ldz, float* work, const int* lwork,
                int* iwork, const int* liwork, int* info) {
  sstedc_("I", n, d, e, z, ldz, work, lwork, iwork, liwork, info, kOptionLen);
}
void call_stedc(const int* n, double* d, double* e, double* z, const int* ldz, double* work, const int* lwork,
                int* iwork, const int* liwork, int* info) {
  dstedc_("I", n, d, e, z, ldz, work, lwork, iwork, liwork, info, kOptionLen);
}

// Householder tridiagonalization for eigh: xSYTRD's blocked algorithm for the lower triangle
// (panels of 32 columns reduced as in xLATRD, xSYR2K trailing updates, xSYTD2 for the last panel)
// with the BLAS-2 steps of the panels done here. OpenBLAS 0.3.21 takes a process-wide lock to get a
// scratch buffer in every ?symv call and every ?gemv call with m + n > 512, and xLATRD makes seven
// such calls per column: with 16 threads each reducing its own matrix, a 0.4 us ssymv call took
// 16 us and ssytrd ran 1.55x slower than alone (H200 host). The steps below take no lock.

constexpr int kTridiagonalPanel = 32;  // xSYTRD's block size and crossover

// Elements a BLAS kernel may read past the end of a matrix: OpenBLAS's SSE ssymv kernel (Prescott,
// which OpenBLAS picks on CPUs it does not recognize) loads up to 16 bytes past A's last element,
// measured with a guard page after it (cpp/tests/linalg/lapack_bounds_test.cpp). Wherever LAPACK
// reduces a matrix near its end, it reduces a copy with this much slack behind it, so that no
// caller's buffer need have any.
template <typename T>
constexpr std::size_t kOverread = 64 / sizeof(T);

// Copies the lower triangle of the n x n matrix `from` (ldf) onto that of `to` (ldt).
template <typename T>
void copy_lower(int n, const T* from, std::size_t ldf, T* to, std::size_t ldt) {
  for (int j = 0; j < n; ++j) {
    std::memcpy(to + j + j * ldt, from + j + j * ldf, static_cast<std::size_t>(n - j) * sizeof(T));
  }
}

// One pass of symv_lower over rows [i, n) of columns c0..c3, V's lanes at a time: y(rows) +=
// A(rows, cols) x(cols) and s_k += A(rows, k) .* x(rows). Returns the first row left over.
template <typename V, typename T>
[[gnu::always_inline]] inline int symv_sweep(int i, int n, const T* const c[4], const T* xc, const T* x, T* y,
                                             V s[4]) {
  constexpr int W = sizeof(V) / sizeof(T);
  const V x0 = xc[0] - V{}, x1 = xc[1] - V{}, x2 = xc[2] - V{}, x3 = xc[3] - V{};
  V s0 = s[0], s1 = s[1], s2 = s[2], s3 = s[3];
  for (; i + W <= n; i += W) {
    V a0, a1, a2, a3, xi, yi;
    load(a0, c[0] + i);
    load(a1, c[1] + i);
    load(a2, c[2] + i);
    load(a3, c[3] + i);
    load(xi, x + i);
    load(yi, y + i);
    yi += (a0 * x0 + a1 * x1) + (a2 * x2 + a3 * x3);
    store(y + i, yi);
    s0 += a0 * xi;
    s1 += a1 * xi;
    s2 += a2 * xi;
    s3 += a3 * xi;
  }
  s[0] = s0;
  s[1] = s1;
  s[2] = s2;
  s[3] = s3;
  return i;
}

// y = A x for the n x n symmetric A of which the lower triangle is stored. Four columns per pass:
// their lower part adds into y as a column update, their mirrored upper part is four dot products.
// The pass holds 14 vectors of `Bytes` (four columns, their x, their sums, x(i) and y(i)), so `Bytes`
// is the instruction set's register width: wider vectors than the registers spill in the loop (64-byte
// vectors on AVX2's sixteen 32-byte registers made this 2.7x slower than OpenBLAS's ssymv on a Zen 3).
template <typename T, int Bytes>
[[gnu::always_inline]] inline void symv_lower(int n, const T* a, std::size_t lda, const T* x, T* y) {
  constexpr int kLanes = std::max(4, Bytes / static_cast<int>(sizeof(T)));  // (a Quad at least: double on SSE2)
  std::fill(y, y + n, T(0));
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const T* const c[4] = {a + j * lda, a + (j + 1) * lda, a + (j + 2) * lda, a + (j + 3) * lda};
    T t[4];  // the 4 x 4 diagonal block, read from its lower triangle
    for (int k = 0; k < 4; ++k) {
      t[k] = 0;
      for (int r = 0; r < 4; ++r) t[k] += (r <= k ? c[r][j + k] : c[k][j + r]) * x[j + r];
    }
    Vector<T, kLanes> wide[4] = {};
    int i = symv_sweep(j + 4, n, c, x + j, x, y, wide);
    Quad<T> quad[4];
    for (int k = 0; k < 4; ++k) fold_to_quad<T, kLanes>(wide[k], quad[k]);
    i = symv_sweep(i, n, c, x + j, x, y, quad);
    Quad<T> sums;
    sum4<T>(quad[0], quad[1], quad[2], quad[3], sums);
    for (; i < n; ++i) {
      y[i] += (c[0][i] * x[j] + c[1][i] * x[j + 1]) + (c[2][i] * x[j + 2] + c[3][i] * x[j + 3]);
      for (int k = 0; k < 4; ++k) t[k] += c[k][i] * x[i];
    }
    for (int k = 0; k < 4; ++k) y[j + k] += t[k] + sums[k];
  }
  for (; j < n; ++j) {
    const T* c = a + j * lda;
    T t = c[j] * x[j];
    for (int i = j + 1; i < n; ++i) {
      y[i] += c[i] * x[j];
      t += c[i] * x[i];
    }
    y[j] += t;
  }
}

// xLATRD, lower: reduces the first nb columns of the n x n matrix `a` (nb < n) and returns W
// (n x nb) such that the trailing matrix's update is A -= V W^T + W V^T, V the reflectors.
template <typename T, int Bytes>
[[gnu::always_inline]] inline void latrd_lower(int n, int nb, T* a, std::size_t lda, T* e, T* tau, T* w,
                                               std::size_t ldw) {
  for (int j = 0; j < nb; ++j) {
    // Column j, brought up to date with this panel's earlier reflectors.
    T* column = a + j + j * lda;
    for (int k = 0; k < j; ++k) {
      axpy2(n - j, -w[j + k * ldw], a + j + k * lda, -a[j + k * lda], w + j + k * ldw, column);
    }
    // The reflector H(j) = I - tau v v^T that annihilates column j below its subdiagonal.
    const int m = n - j - 1;
    T* v = column + 1;
    call_larfg(&m, /* alpha = */ v, /* x = */ v + (m > 1 ? 1 : 0), &tau[j]);
    e[j] = v[0];
    v[0] = T(1);
    // W(:, j) = tau (A' v) - (tau^2 / 2) (v^T A' v) v with A' the trailing matrix as updated by the
    // earlier reflectors: A' v = A v - V (W^T v) - W (V^T v).
    T* wj = w + (j + 1) + j * ldw;
    symv_lower<T, Bytes>(m, a + (j + 1) + (j + 1) * lda, lda, v, wj);
    for (int k = 0; k < j; ++k) {
      const T* vk = a + (j + 1) + k * lda;
      const T* wk = w + (j + 1) + k * ldw;
      T wk_v, vk_v;
      dot2(m, wk, vk, v, wk_v, vk_v);
      axpy2(m, -wk_v, vk, -vk_v, wk, wj);
    }
    scale_add(m, tau[j], wj, T(-0.5) * tau[j] * tau[j] * dot(m, wj, v), v);
  }
}

template <typename T, int Bytes>
[[gnu::always_inline]] inline void tridiagonalize_lower(int n, T* a, int lda, T* d, T* e, T* tau, T* w) {
  constexpr int kPanel = kTridiagonalPanel;
  const std::size_t ld = static_cast<std::size_t>(lda);
  const T one = 1, minus_one = -1;
  int i = 0;
  for (; n - i > kPanel; i += kPanel) {
    T* panel = a + i + i * ld;
    latrd_lower<T, Bytes>(n - i, kPanel, panel, ld, e + i, tau + i, w, static_cast<std::size_t>(n));
    const int trailing = n - i - kPanel;
    call_syr2k(&trailing, /* k = */ &kPanel, &minus_one, panel + kPanel, &lda, w + kPanel, /* ldb = */ &n, &one,
               panel + kPanel + kPanel * ld, &lda);
    for (int j = i; j < i + kPanel; ++j) {
      a[j + 1 + j * ld] = e[j];
      d[j] = a[j + j * ld];
    }
  }
  // The last panel ends at a's last element: xSYTD2 reduces a copy in `w` (rest^2 <= kPanel n entries).
  const int rest = n - i;
  copy_lower(rest, a + i + i * ld, ld, w, static_cast<std::size_t>(rest));
  int info = 0;
  call_sytd2(&rest, w, &rest, d + i, e + i, tau + i, &info);
  check_info<T>("eigh", "sytd2", info, n);
  copy_lower(rest, w, static_cast<std::size_t>(rest), a + i + i * ld, ld);
}

// Reduces the lower triangle of `a` to tridiagonal form d, e with reflectors (a, tau) as
// xSYTRD('L') does; `w` is n x kTridiagonalPanel + kOverread<T> scratch. Compiled per vector
// instruction set and picked by CPU feature as simd.h describes.
template <typename T>
using TridiagonalizeKernel = void (*)(int n, T* a, int lda, T* d, T* e, T* tau, T* w);

template <typename T>
void tridiagonalize_baseline(int n, T* a, int lda, T* d, T* e, T* tau, T* w) {
  tridiagonalize_lower<T, kRegisterBytes>(n, a, lda, d, e, tau, w);
}

#if defined(ASTERIA_SIMD_DISPATCH_BY_CPU)
template <typename T>
[[gnu::target("arch=x86-64-v4")]] void tridiagonalize_avx512(int n, T* a, int lda, T* d, T* e, T* tau, T* w) {
  tridiagonalize_lower<T, 64>(n, a, lda, d, e, tau, w);
}
template <typename T>
[[gnu::target("arch=x86-64-v3")]] void tridiagonalize_avx2(int n, T* a, int lda, T* d, T* e, T* tau, T* w) {
  tridiagonalize_lower<T, 32>(n, a, lda, d, e, tau, w);
}
#endif

template <typename T>
void tridiagonalize(int n, T* a, int lda, T* d, T* e, T* tau, T* w) {
#if defined(ASTERIA_SIMD_DISPATCH_BY_CPU)
  static const TridiagonalizeKernel<T> kernel =
      widest_supported<TridiagonalizeKernel<T>>(&tridiagonalize_avx512<T>, &tridiagonalize_avx2<T>,
                                                &tridiagonalize_baseline<T>);
#else
  static const TridiagonalizeKernel<T> kernel = &tridiagonalize_baseline<T>;
#endif
  kernel(n, a, lda, d, e, tau, w);
}

}  // namespace

namespace detail {

// The upper triangular T (ldt) of the block reflector H(0) ... H(k-1) = I - V T V^T, V (rows x k, ldv)
// dense with explicit unit diagonal and zeros above: xLARFT('F', 'C')'s recurrence
// T(0:i, i) = -tau(i) T(0:i, 0:i) V(:, 0:i)^T V(:, i) on S = V^T V from a single gemm (xLARFT makes
// one gemv and one trmv per column, each taking OpenBLAS's allocation lock).
template <typename T>
void block_reflector_factor(int rows, int k, const T* v, int ldv, const T* tau, T* t, int ldt) {
  const T one = 1, zero = 0;
  call_gemm("T", "N", &k, &k, &rows, &one, v, /* lda = */ &ldv, v, /* ldb = */ &ldv, &zero, t, /* ldc = */ &ldt);
  const std::size_t ld = static_cast<std::size_t>(ldt);
  for (int i = 0; i < k; ++i) {
    T* column = t + i * ld;  // holds S(0:i, i) on entry
    if (tau[i] == T(0)) {  // H(i) = I
      std::fill(column, column + k, T(0));
      continue;
    }
    for (int r = 0; r < i; ++r) {
      T sum = 0;
      for (int c = r; c < i; ++c) sum += t[r + c * ld] * column[c];
      column[r] = -tau[i] * sum;
    }
    column[i] = tau[i];
    std::fill(column + i + 1, column + k, T(0));
  }
}

template <typename T>
void larfg(int n, T* alpha, T* x, T* tau) {
  call_larfg(&n, alpha, x, tau);
}

template void block_reflector_factor<float>(int, int, const float*, int, const float*, float*, int);
template void block_reflector_factor<double>(int, int, const double*, int, const double*, double*, int);
template void larfg<float>(int, float*, float*, float*);
template void larfg<double>(int, double*, double*, double*);

}  // namespace detail

template <typename T>
void syevd(int n, T* a, int lda, T* w, std::vector<T>& work, std::vector<int>& iwork) {
  require(n >= 0, "syevd", "n", n, ">= 0");
  require_leading_dim("syevd", "lda", lda, n);
  if (n == 0) return;

  T work_query = 0;
  int iwork_query = 0;
  int info = 0;
  const int query = -1;
  call_syevd(&n, a, &lda, w, /* work = */ &work_query, /* lwork = */ &query, /* iwork = */ &iwork_query,
             /* liwork = */ &query, &info);
  check_info<T>("syevd", "syevd", info, n);
  // The documented minimum for JOBZ='V' bounds the query from below in case of float rounding. LAPACK
  // works on a copy with kOverread<T> slack (`work`'s head), which the eigenvectors then replace `a` from.
  const std::size_t nn = static_cast<std::size_t>(n), copy_size = nn * nn + kOverread<T>;
  const std::size_t lapack_size = std::max(queried_size(work_query), 1 + 6 * nn + 2 * nn * nn);
  grow(work, copy_size + lapack_size);
  grow(iwork, std::max(static_cast<std::size_t>(iwork_query), 3 + 5 * nn));

  const std::size_t ld = static_cast<std::size_t>(lda);
  T* copy = work.data();
  copy_lower(n, a, ld, copy, nn);
  const int lwork = static_cast<int>(std::min<std::size_t>(lapack_size, std::numeric_limits<int>::max()));
  const int liwork = static_cast<int>(iwork.size());
  call_syevd(&n, copy, /* lda = */ &n, w, work.data() + copy_size, &lwork, iwork.data(), &liwork, &info);
  check_info<T>("syevd", "syevd", info, n);
  for (std::size_t j = 0; j < nn; ++j) std::memcpy(a + j * ld, copy + j * nn, nn * sizeof(T));
}

template <typename T>
void eigh(int n, T* a, int lda, T* w, std::vector<T>& work, std::vector<int>& iwork) {
  require(n >= 0, "eigh", "n", n, ">= 0");
  require_leading_dim("eigh", "lda", lda, n);
  if (n == 0) return;

  // The tridiagonalization leaves, as xSYTRD('L') does, H(i) = I - tau(i) v v^T with v(i+1) = 1
  // and v(i+2:n) in a(i+2:n, i), Q = H(1) ... H(n-1): the reflectors of a QR factorization stored
  // in a(2:n, 1:n-1), acting on rows 2:n. They are grouped into blocks of kBlock,
  // H(block) = I - V T V^T, with V packed block after block (block b is (m - b kBlock) x kBlock).
  constexpr int kBlock = 64;
  constexpr int kSlice = 256;
  const std::size_t nn = static_cast<std::size_t>(n);
  const int m = n - 1;  // rows the reflectors act on, and their number
  const int blocks = (m + kBlock - 1) / kBlock;
  const auto v_offset = [m](int b) {
    return static_cast<std::size_t>(kBlock) * (static_cast<std::size_t>(b) * m - kBlock * (b * (b - 1) / 2));
  };

  int info = 0;
  const int query = -1;
  T stedc_query = 0;
  int stedc_iwork_query = 0;
  call_stedc(&n, w, /* e = */ w, /* z = */ a, /* ldz = */ &lda, /* work = */ &stedc_query, /* lwork = */ &query,
             /* iwork = */ &stedc_iwork_query, /* liwork = */ &query, &info);
  check_info<T>("eigh", "stedc", info, n);

  // Layout of `work`: e | tau | packed V blocks | T blocks | two slice products | scratch of the
  // tridiagonalization, then of xSTEDC.
  const std::size_t e_at = 0, tau_at = nn, v_at = 2 * nn, t_at = v_at + v_offset(blocks);
  const std::size_t slice_at = t_at + static_cast<std::size_t>(blocks) * kBlock * kBlock;
  const std::size_t lapack_at = slice_at + 2 * static_cast<std::size_t>(kBlock) * kSlice;
  const std::size_t lapack_size =
      std::max({queried_size(stedc_query), 1 + 4 * nn + nn * nn, kTridiagonalPanel * nn + kOverread<T>});
  grow(work, lapack_at + lapack_size);
  grow(iwork, std::max(static_cast<std::size_t>(stedc_iwork_query), 3 + 5 * nn));
  T* e = work.data() + e_at;
  T* tau = work.data() + tau_at;
  T* lapack_work = work.data() + lapack_at;
  const int lwork = static_cast<int>(std::min<std::size_t>(lapack_size, std::numeric_limits<int>::max()));
  const int liwork = static_cast<int>(iwork.size());

  tridiagonalize(n, a, lda, /* d = */ w, e, tau, /* w = */ lapack_work);

  // Pack each block's V densely (explicit unit diagonal and zeros above) so that gemm can use it,
  // and form its T; `a` is then free to receive Z.
  const std::size_t ld = static_cast<std::size_t>(lda);
  for (int b = 0; b < blocks; ++b) {
    const int first = b * kBlock, width = std::min(kBlock, m - first), rows = m - first;
    T* v = work.data() + v_at + v_offset(b);
    T* t = work.data() + t_at + static_cast<std::size_t>(b) * kBlock * kBlock;
    for (int j = 0; j < width; ++j) {
      T* column = v + static_cast<std::size_t>(j) * rows;
      const T* reflector = a + 1 + first + (first + j) * ld;  // a(first + 2 : n, first + j + 1), 1-based
      std::fill(column, column + j, T(0));
      column[j] = T(1);
      std::copy(reflector + j + 1, reflector + rows, column + j + 1);
    }
    detail::block_reflector_factor(rows, width, v, /* ldv = */ rows, tau + first, t, kBlock);
  }

  call_stedc(&n, /* d = */ w, e, /* z = */ a, /* ldz = */ &lda, lapack_work, &lwork, iwork.data(), &liwork, &info);
  check_info<T>("eigh", "stedc", info, n);

  // Q Z = H(block 0) (... (H(last block) Z)), slice by slice of Z's columns.
  T* vtz = work.data() + slice_at;
  T* tvtz = vtz + static_cast<std::size_t>(kBlock) * kSlice;
  const T one = 1, minus_one = -1, zero = 0;
  for (int c0 = 0; c0 < n; c0 += kSlice) {
    const int slice = std::min(kSlice, n - c0);
    T* z = a + 1 + c0 * ld;
    for (int b = blocks - 1; b >= 0; --b) {
      const int first = b * kBlock, width = std::min(kBlock, m - first), rows = m - first;
      const T* v = work.data() + v_at + v_offset(b);
      const T* t = work.data() + t_at + static_cast<std::size_t>(b) * kBlock * kBlock;
      call_gemm("T", "N", &width, &slice, &rows, &one, v, /* lda = */ &rows, z + first, /* ldb = */ &lda, &zero, vtz,
                /* ldc = */ &width);
      call_gemm("N", "N", &width, &slice, &width, &one, t, /* lda = */ &kBlock, vtz, /* ldb = */ &width, &zero, tvtz,
                /* ldc = */ &width);
      call_gemm("N", "N", &rows, &slice, &width, &minus_one, v, /* lda = */ &rows, tvtz, /* ldb = */ &width, &one,
                z + first, /* ldc = */ &lda);
    }
  }
}

template <typename T>
void syrk_lower(int n, int k, T alpha, const T* a, int lda, T beta, T* c, int ldc) {
  require(n >= 0, "syrk", "n", n, ">= 0");
  require(k >= 0, "syrk", "k", k, ">= 0");
  require_leading_dim("syrk", "lda", lda, n);
  require_leading_dim("syrk", "ldc", ldc, n);
  if (n == 0) return;
  call_syrk(&n, &k, &alpha, a, &lda, &beta, c, &ldc);
}

template <typename T>
void gemm(bool trans_a, bool trans_b, int m, int n, int k, T alpha, const T* a, int lda, const T* b, int ldb,
          T beta, T* c, int ldc) {
  require(m >= 0, "gemm", "m", m, ">= 0");
  require(n >= 0, "gemm", "n", n, ">= 0");
  require(k >= 0, "gemm", "k", k, ">= 0");
  require_leading_dim("gemm", "lda", lda, trans_a ? k : m);
  require_leading_dim("gemm", "ldb", ldb, trans_b ? n : k);
  require_leading_dim("gemm", "ldc", ldc, m);
  if (m == 0 || n == 0) return;
  call_gemm(trans_a ? "T" : "N", trans_b ? "T" : "N", &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

template <typename T>
void symmetrize_from_lower(int n, T* a, int lda) {
  require(n >= 0, "symmetrize_from_lower", "n", n, ">= 0");
  require_leading_dim("symmetrize_from_lower", "lda", lda, n);
  // Column j's upper part a(i, j), i < j, comes from row j's lower part a(j, i); blocking keeps
  // both the strided reads and the contiguous writes in cache.
  constexpr int kBlock = 64;
  const std::size_t ld = static_cast<std::size_t>(lda);
  for (int jb = 0; jb < n; jb += kBlock) {
    for (int ib = 0; ib <= jb; ib += kBlock) {
      const int j_end = std::min(jb + kBlock, n);
      for (int j = jb; j < j_end; ++j) {
        const int i_end = std::min(ib + kBlock, j);
        for (int i = ib; i < i_end; ++i) a[i + j * ld] = a[j + i * ld];
      }
    }
  }
}

const char* simd_kernels() { return simd::kernels(); }

template void syevd<float>(int, float*, int, float*, std::vector<float>&, std::vector<int>&);
template void syevd<double>(int, double*, int, double*, std::vector<double>&, std::vector<int>&);
template void eigh<float>(int, float*, int, float*, std::vector<float>&, std::vector<int>&);
template void eigh<double>(int, double*, int, double*, std::vector<double>&, std::vector<int>&);
template void syrk_lower<float>(int, int, float, const float*, int, float, float*, int);
template void syrk_lower<double>(int, int, double, const double*, int, double, double*, int);
template void gemm<float>(bool, bool, int, int, int, float, const float*, int, const float*, int, float, float*,
                          int);
template void gemm<double>(bool, bool, int, int, int, double, const double*, int, const double*, int, double,
                           double*, int);
template void symmetrize_from_lower<float>(int, float*, int);
template void symmetrize_from_lower<double>(int, double*, int);

}  // namespace asteria::linalg
