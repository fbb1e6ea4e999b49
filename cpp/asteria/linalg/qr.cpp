// Householder QR with the Q factor formed explicitly, blocked wider than LAPACK's xGEQRF/xORGQR and
// without small BLAS calls.
//
// Panels are kPanel = 128 columns wide. Each panel is factored here: inner panels of kInner = 32
// columns column by column with the vector kernels of simd.h (reflectors by xLARFG, as xGEQRF makes
// them), each inner panel's block reflector then applied to the rest of the panel through gemm. The
// panel's triangular factor T comes from one gemm (detail::block_reflector_factor). Trailing updates
// and the backward accumulation of Q are three gemms per panel. So a QR of order n makes about
// 20 n / kPanel BLAS calls, all of them level 3. LAPACK's recursive xGEQRT3 on the same panels made
// about 1000 small gemm/trmm calls per panel, and OpenBLAS 0.3.21 takes a process-wide lock to get a
// scratch buffer in each: on the H200 host, 16 workers each refreshing its own 1024 block did 102
// SOAP refreshes/s that way and 170/s with the panels factored here. Same reflectors and signs as
// xGEQRF + xORGQR.
#include "asteria/linalg/qr.h"

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "asteria/common/errors.h"
#include "asteria/linalg/detail.h"
#include "asteria/linalg/lapack.h"
#include "asteria/linalg/simd.h"

namespace asteria::linalg {
namespace {

using detail::grow;

constexpr int kPanel = 128;
constexpr int kInner = 32;

void require(bool ok, const char* what, long long value, const std::string& rule) {
  if (!ok) throw InvalidArgument("[qr_q] Invalid " + std::string(what) + "=" + std::to_string(value) + ": must be " + rule);
}

// Copies the reflectors of columns [first, first + k) of a panel (stored below the diagonal of `a`,
// rows x *, lda) into the dense V (rows x *, ldv = rows): zeros above the diagonal, ones on it.
template <typename T>
void pack_reflectors(int rows, int first, int k, const T* a, std::size_t lda, T* v) {
  const std::size_t ldv = static_cast<std::size_t>(rows);
  for (int j = first; j < first + k; ++j) {
    T* column = v + static_cast<std::size_t>(j) * ldv;
    const T* source = a + static_cast<std::size_t>(j) * lda;
    std::fill(column, column + j, T(0));
    column[j] = T(1);
    std::copy(source + j + 1, source + rows, column + j + 1);
  }
}

// C (rows x cols) = H^T C (factoring) or H C (forming Q) for H = I - V T V^T, V rows x k (ldv), in three
// gemms through w and w2 (k x cols each).
template <typename T>
void apply_block_reflector(bool transpose, int rows, int cols, int k, const T* v, int ldv, const T* t, int ldt, T* c,
                           int ldc, T* w, T* w2) {
  gemm(true, false, k, cols, rows, T(1), v, ldv, c, ldc, T(0), w, k);
  gemm(transpose, false, k, cols, k, T(1), t, ldt, w, k, T(0), w2, k);
  gemm(false, false, rows, cols, k, T(-1), v, ldv, w2, k, T(1), c, ldc);
}

// Factors the panel `a` (rows x jb, lda): reflectors below its diagonal, R on and above it, their
// scalars in tau, the dense V (rows x jb) in v and the panel's T (jb x jb) in t (ldt). w and w2 hold
// kInner x jb each.
template <typename T>
[[gnu::always_inline]] inline void factor_panel_kernel(int rows, int jb, T* a, int lda, T* tau, T* v, T* t, int ldt,
                                                       T* w, T* w2) {
  const std::size_t ld = static_cast<std::size_t>(lda), ldv = static_cast<std::size_t>(rows);
  const std::size_t tld = static_cast<std::size_t>(ldt);
  for (int s = 0; s < jb; s += kInner) {
    const int ib = std::min(kInner, jb - s);
    for (int j = s; j < s + ib; ++j) {
      T* column = a + j + j * ld;  // rows - j entries, from the diagonal down
      const int len = rows - j;
      detail::larfg(len, column, column + (len > 1 ? 1 : 0), &tau[j]);
      if (tau[j] == T(0)) continue;  // H(j) = I
      const T beta = column[0];
      column[0] = T(1);
      for (int c = j + 1; c < s + ib; ++c) {  // H(j)^T on the inner panel's later columns
        T* target = a + j + c * ld;
        simd::scale_add(len, T(1), target, -tau[j] * simd::dot(len, column, target), column);
      }
      column[0] = beta;
    }
    pack_reflectors(rows, s, ib, a, ld, v);
    const int rest = jb - s - ib;
    if (rest == 0) break;
    T* t_inner = t + s + s * tld;
    const T* v_inner = v + s + s * ldv;
    detail::block_reflector_factor(rows - s, ib, v_inner, rows, tau + s, t_inner, ldt);
    apply_block_reflector(true, rows - s, rest, ib, v_inner, rows, t_inner, ldt, a + s + (s + ib) * ld, lda, w, w2);
  }
  detail::block_reflector_factor(rows, jb, v, rows, tau, t, ldt);
}

template <typename T>
using FactorPanel = void (*)(int rows, int jb, T* a, int lda, T* tau, T* v, T* t, int ldt, T* w, T* w2);

template <typename T>
void factor_panel_baseline(int rows, int jb, T* a, int lda, T* tau, T* v, T* t, int ldt, T* w, T* w2) {
  factor_panel_kernel(rows, jb, a, lda, tau, v, t, ldt, w, w2);
}

// Compiled per vector instruction set and picked by CPU feature as simd.h describes.
#if defined(ASTERIA_SIMD_DISPATCH_BY_CPU)
template <typename T>
[[gnu::target("arch=x86-64-v4")]] void factor_panel_avx512(int rows, int jb, T* a, int lda, T* tau, T* v, T* t,
                                                           int ldt, T* w, T* w2) {
  factor_panel_kernel(rows, jb, a, lda, tau, v, t, ldt, w, w2);
}
template <typename T>
[[gnu::target("arch=x86-64-v3")]] void factor_panel_avx2(int rows, int jb, T* a, int lda, T* tau, T* v, T* t,
                                                         int ldt, T* w, T* w2) {
  factor_panel_kernel(rows, jb, a, lda, tau, v, t, ldt, w, w2);
}
#endif

template <typename T>
void factor_panel(int rows, int jb, T* a, int lda, T* tau, T* v, T* t, int ldt, T* w, T* w2) {
#if defined(ASTERIA_SIMD_DISPATCH_BY_CPU)
  static const FactorPanel<T> kernel = simd::widest_supported<FactorPanel<T>>(
      &factor_panel_avx512<T>, &factor_panel_avx2<T>, &factor_panel_baseline<T>);
#else
  static const FactorPanel<T> kernel = &factor_panel_baseline<T>;
#endif
  kernel(rows, jb, a, lda, tau, v, t, ldt, w, w2);
}

}  // namespace

template <typename T>
void qr_q(int m, int n, T* a, int lda, std::vector<T>& work) {
  require(n >= 0, "n", n, ">= 0");
  require(m >= n, "m", m, ">= n=" + std::to_string(n));
  require(lda >= std::max(1, m), "lda", lda, ">= max(1, " + std::to_string(m) + ")");
  if (n == 0) return;
  const std::size_t ld = static_cast<std::size_t>(lda), nn = static_cast<std::size_t>(n);
  const std::size_t panels = (nn + kPanel - 1) / kPanel;
  // T factors (kPanel x kPanel per panel), tau (n), one panel's dense V (m x kPanel) and two
  // kPanel x n products, all in one buffer.
  const std::size_t t_size = panels * kPanel * kPanel, v_size = static_cast<std::size_t>(m) * kPanel;
  grow(work, t_size + nn + v_size + 2 * kPanel * nn);
  T* t_all = work.data();
  T* tau = t_all + t_size;
  T* v = tau + nn;
  T* w = v + v_size;
  T* w2 = w + kPanel * nn;
  auto panel_t = [&](int k) { return t_all + static_cast<std::size_t>(k / kPanel) * kPanel * kPanel; };
  auto at = [&](int row, int col) { return a + row + static_cast<std::size_t>(col) * ld; };

  // Factor: each panel, then its block reflector applied (transposed) to the columns right of it.
  for (int k = 0; k < n; k += kPanel) {
    const int jb = std::min(kPanel, n - k), rows = m - k, rest = n - k - jb;
    factor_panel(rows, jb, at(k, k), lda, tau + k, v, panel_t(k), kPanel, w, w2);
    if (rest > 0) apply_block_reflector(true, rows, rest, jb, v, rows, panel_t(k), kPanel, at(k, k + jb), lda, w, w2);
  }
  // Form Q backward, as xORGQR does: the columns right of panel k already hold H_{k+1}... [0; I] (zero in
  // rows k..k+jb), so H_k applies to them; panel k's own columns are H_k [I; 0] = [I; 0] - V (T V1^T).
  for (int k = ((n - 1) / kPanel) * kPanel; k >= 0; k -= kPanel) {
    const int jb = std::min(kPanel, n - k), rows = m - k, rest = n - k - jb;
    pack_reflectors(rows, 0, jb, at(k, k), ld, v);
    if (rest > 0) apply_block_reflector(false, rows, rest, jb, v, rows, panel_t(k), kPanel, at(k, k + jb), lda, w, w2);
    gemm(false, true, jb, jb, jb, T(1), panel_t(k), kPanel, v, rows, T(0), w, jb);  // T V1^T
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
