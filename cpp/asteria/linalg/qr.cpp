// Householder QR with the Q factor formed explicitly, blocked wider than LAPACK's xGEQRF/xORGQR.
//
// The reference LAPACK behind OpenBLAS factors and forms Q in panels of 32 columns, each panel's
// reflectors built by level-2 calls; at n = 1024-2048 most of the time then goes to memory-bound
// work. Here panels are kPanel = 128 wide and factored by xGEQRT3 (recursive, mostly level 3), which
// also returns each panel's triangular factor T, kept for forming Q. The trailing updates and the
// backward accumulation of Q go through xLARFB, and each panel's own columns of Q come from one
// triangular product and one gemm. Same reflectors and signs as xGEQRF + xORGQR (agreement ~1e-6),
// measured 1.4x faster in float32 on one core at n = 1024 and 2048 (bench note in docs/results.md).
#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "asteria/common/errors.h"
#include "asteria/linalg/detail.h"
#include "asteria/linalg/lapack.h"

// The Fortran interface OpenBLAS exports (LP64), with gfortran's hidden CHARACTER lengths.
extern "C" {
void sgeqrt3_(const int* m, const int* n, float* a, const int* lda, float* t, const int* ldt, int* info);
void dgeqrt3_(const int* m, const int* n, double* a, const int* lda, double* t, const int* ldt, int* info);
void slarfb_(const char* side, const char* trans, const char* direct, const char* storev, const int* m, const int* n,
             const int* k, const float* v, const int* ldv, const float* t, const int* ldt, float* c, const int* ldc,
             float* work, const int* ldwork, std::size_t, std::size_t, std::size_t, std::size_t);
void dlarfb_(const char* side, const char* trans, const char* direct, const char* storev, const int* m, const int* n,
             const int* k, const double* v, const int* ldv, const double* t, const int* ldt, double* c,
             const int* ldc, double* work, const int* ldwork, std::size_t, std::size_t, std::size_t, std::size_t);
void strmm_(const char* side, const char* uplo, const char* transa, const char* diag, const int* m, const int* n,
            const float* alpha, const float* a, const int* lda, float* b, const int* ldb, std::size_t, std::size_t,
            std::size_t, std::size_t);
void dtrmm_(const char* side, const char* uplo, const char* transa, const char* diag, const int* m, const int* n,
            const double* alpha, const double* a, const int* lda, double* b, const int* ldb, std::size_t,
            std::size_t, std::size_t, std::size_t);
}

namespace asteria::linalg {
namespace {

using detail::grow;

constexpr int kPanel = 128;
constexpr std::size_t kLen = 1;  // every option passed is a single letter

void geqrt3(const int* m, const int* n, float* a, const int* lda, float* t, const int* ldt, int* info) {
  sgeqrt3_(m, n, a, lda, t, ldt, info);
}
void geqrt3(const int* m, const int* n, double* a, const int* lda, double* t, const int* ldt, int* info) {
  dgeqrt3_(m, n, a, lda, t, ldt, info);
}

// C (m x n) = H C with H = I - V T V^T (trans "N") or H^T C (trans "T"); V is m x k, forward, columnwise.
void larfb(const char* trans, int m, int n, int k, const float* v, int ldv, const float* t, int ldt, float* c,
           int ldc, float* work) {
  slarfb_("L", trans, "F", "C", &m, &n, &k, v, &ldv, t, &ldt, c, &ldc, work, &n, kLen, kLen, kLen, kLen);
}
void larfb(const char* trans, int m, int n, int k, const double* v, int ldv, const double* t, int ldt, double* c,
           int ldc, double* work) {
  dlarfb_("L", trans, "F", "C", &m, &n, &k, v, &ldv, t, &ldt, c, &ldc, work, &n, kLen, kLen, kLen, kLen);
}

// B (k x k) = T B with T upper triangular.
void trmm_upper(int k, const float* t, int ldt, float* b) {
  const float one = 1;
  strmm_("L", "U", "N", "N", &k, &k, &one, t, &ldt, b, &k, kLen, kLen, kLen, kLen);
}
void trmm_upper(int k, const double* t, int ldt, double* b) {
  const double one = 1;
  dtrmm_("L", "U", "N", "N", &k, &k, &one, t, &ldt, b, &k, kLen, kLen, kLen, kLen);
}

void require(bool ok, const char* what, long long value, const std::string& rule) {
  if (!ok) throw InvalidArgument("[qr_q] Invalid " + std::string(what) + "=" + std::to_string(value) + ": must be " + rule);
}

}  // namespace

template <typename T>
void qr_q(int m, int n, T* a, int lda, std::vector<T>& work) {
  require(n >= 0, "n", n, ">= 0");
  require(m >= n, "m", m, ">= n=" + std::to_string(n));
  require(lda >= std::max(1, m), "lda", lda, ">= max(1, " + std::to_string(m) + ")");
  if (n == 0) return;
  const std::size_t ld = static_cast<std::size_t>(lda);
  const std::size_t panels = static_cast<std::size_t>((n + kPanel - 1) / kPanel);
  // T factors (kPanel x kPanel per panel), larfb's workspace (n x kPanel), one panel's reflectors
  // (m x kPanel) and a kPanel x kPanel product, all in one buffer.
  const std::size_t t_size = panels * kPanel * kPanel;
  const std::size_t larfb_size = static_cast<std::size_t>(n) * kPanel;
  const std::size_t v_size = static_cast<std::size_t>(m) * kPanel;
  grow(work, t_size + larfb_size + v_size + static_cast<std::size_t>(kPanel) * kPanel);
  T* t_all = work.data();
  T* scratch = t_all + t_size;
  T* v = scratch + larfb_size;
  T* w = v + v_size;
  auto panel_t = [&](int k) { return t_all + static_cast<std::size_t>(k / kPanel) * kPanel * kPanel; };
  auto at = [&](int row, int col) { return a + row + static_cast<std::size_t>(col) * ld; };

  // Factor: each panel by geqrt3, then its reflectors applied (transposed) to the columns right of it.
  for (int k = 0; k < n; k += kPanel) {
    const int jb = std::min(kPanel, n - k), rows = m - k, rest = n - k - jb;
    int info = 0;
    geqrt3(&rows, &jb, at(k, k), &lda, panel_t(k), &kPanel, &info);
    if (info != 0) throw NumericalError("[qr_q] geqrt3 failed, info=" + std::to_string(info));
    if (rest > 0) larfb("T", rows, rest, jb, at(k, k), lda, panel_t(k), kPanel, at(k, k + jb), lda, scratch);
  }
  // Form Q backward, as xORGQR does: the columns right of panel k already hold H_{k+1}... [0; I] (zero in
  // rows k..k+jb), so H_k applies to them; panel k's own columns are H_k [I; 0] = [I; 0] - V (T V1^T).
  for (int k = ((n - 1) / kPanel) * kPanel; k >= 0; k -= kPanel) {
    const int jb = std::min(kPanel, n - k), rows = m - k, rest = n - k - jb;
    if (rest > 0) larfb("N", rows, rest, jb, at(k, k), lda, panel_t(k), kPanel, at(k, k + jb), lda, scratch);
    for (int j = 0; j < jb; ++j) {  // V: unit lower trapezoidal, copied out before the panel is overwritten
      T* column = v + static_cast<std::size_t>(j) * rows;
      for (int i = 0; i < rows; ++i) column[i] = i < j ? T(0) : i == j ? T(1) : *at(k + i, k + j);
    }
    for (int j = 0; j < jb; ++j) {
      for (int i = 0; i < jb; ++i) w[i + static_cast<std::size_t>(j) * jb] = v[j + static_cast<std::size_t>(i) * rows];
    }
    trmm_upper(jb, panel_t(k), kPanel, w);
    gemm(false, false, rows, jb, jb, T(-1), v, rows, w, jb, T(0), at(k, k), lda);
    for (int j = 0; j < jb; ++j) {
      *at(k + j, k + j) += T(1);
      std::fill(at(0, k + j), at(k, k + j), T(0));
    }
  }
}

template void qr_q<float>(int, int, float*, int, std::vector<float>&);
template void qr_q<double>(int, int, double*, int, std::vector<double>&);

}  // namespace asteria::linalg
