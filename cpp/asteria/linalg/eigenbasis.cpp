#include "asteria/linalg/eigenbasis.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <limits>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "asteria/common/errors.h"
#include "asteria/linalg/detail.h"
#include "asteria/linalg/lapack.h"
#include "asteria/linalg/qr.h"

namespace asteria::linalg {
namespace {

using detail::all_within;
using detail::grow;

void check_arguments(const char* routine, int n, bool pointers_ok, double scale, double skip_tol) {
  const std::string where = std::string("[") + routine + "] ";
  if (n < 0) throw InvalidArgument(where + "Invalid n=" + std::to_string(n) + ": must be >= 0");
  if (n > 0 && !pointers_ok) {
    throw InvalidArgument(where + "Invalid null matrix pointer for n=" + std::to_string(n));
  }
  if (!(std::isfinite(scale) && scale > 0)) {
    throw InvalidArgument(where + "Invalid scale=" + format_number(scale) + ": must be a finite number > 0");
  }
  if (!(std::isfinite(skip_tol) && skip_tol >= 0)) {
    throw InvalidArgument(where + "Invalid skip_tol=" + format_number(skip_tol) + ": must be a finite number >= 0");
  }
}

// Throws NumericalError naming the first non-finite entry of the n x n torch-layout matrix `x`.
template <typename In>
void require_finite_input(const char* routine, const char* name, int n, const In* x) {
  const std::size_t count = static_cast<std::size_t>(n) * static_cast<std::size_t>(n);
  if (all_within(x, count)) return;
  const std::size_t k =
      static_cast<std::size_t>(std::find_if_not(x, x + count, [](In v) { return std::isfinite(v); }) - x);
  const std::size_t nn = static_cast<std::size_t>(n);
  throw NumericalError(std::string("[") + routine + "] non-finite input " + name + "(" + std::to_string(k / nn) +
                       ", " + std::to_string(k % nn) + ")=" + format_number(x[k]) + " (n=" + std::to_string(n) + ")");
}

// dst[j * n + r] = src[r * n + order[j]] (order: the identity when null), converting: turns torch's
// row-major layout into LAPACK's column-major one and back, optionally gathering columns. Tiled so that
// the strided side stays in cache.
template <typename From, typename To>
void transpose(int n, const From* src, To* dst, const int* order = nullptr) {
  constexpr int kTile = 64;
  const std::size_t nn = static_cast<std::size_t>(n);
  for (int jb = 0; jb < n; jb += kTile) {
    const int j_end = std::min(jb + kTile, n);
    for (int rb = 0; rb < n; rb += kTile) {
      const int r_end = std::min(rb + kTile, n);
      for (int j = jb; j < j_end; ++j) {
        const std::size_t source = static_cast<std::size_t>(order != nullptr ? order[j] : j);
        for (int r = rb; r < r_end; ++r) dst[j * nn + r] = static_cast<To>(src[r * nn + source]);
      }
    }
  }
}

// `x` (count entries) itself when it is already of type T, else a converted copy in `buffer`.
template <typename T, typename In>
const T* as_precision(const In* x, std::size_t count, std::vector<T>& buffer) {
  if constexpr (std::is_same_v<T, In>) {
    return x;
  } else {
    grow(buffer, count);
    std::transform(x, x + count, buffer.begin(), [](In v) { return static_cast<T>(v); });
    return buffer.data();
  }
}

// Per-thread buffers, grown to the largest n seen and kept (see inverse_root.cpp). Matrices are
// column-major with leading dimension n.
template <typename T>
struct Workspace {
  std::vector<T> a;        // eigenbasis(): copy of A, overwritten by the eigenvectors; qr_refresh(): A converted
  std::vector<T> basis;    // qr_refresh(): Q_prev converted (float64 retry only)
  std::vector<T> product;  // T = scale A Q_prev, row-major
  std::vector<T> factor;   // T's columns in `order`, then the Q factor
  std::vector<T> gram;     // M = Q_prev^T T (adaptive skip only)
  std::vector<T> w, work;
  std::vector<int> iwork;
  std::vector<double> est;     // diag(M) in Q_prev's order
  std::vector<double> values;  // the result's eigenvalues or estimates, in the result's order
  std::vector<int> order;
};

template <typename T>
Workspace<T>& workspace() {
  thread_local Workspace<T> ws;
  return ws;
}

std::string non_finite_result(int n, double scale) {
  return "non-finite result (n=" + std::to_string(n) + ", scale=" + format_number(scale) + ")";
}

// Eigenvectors of A loaded into ws.a, sorted by descending eigenvalue, left in ws.a; the eigenvalues
// of scale * A in ws.values. Returns false when the result is not finite.
template <typename T>
bool compute_eigenbasis(int n, double scale, Workspace<T>& ws) {
  const std::size_t nn = static_cast<std::size_t>(n);
  grow(ws.w, nn);
  grow(ws.values, nn);
  T* z = ws.a.data();
  // float32 takes the restructured eigh (the throughput path); float64, the retry, takes LAPACK's
  // own xSYEVD so that a failure of one code path is retried by another.
  if constexpr (std::is_same_v<T, float>) {
    eigh(n, z, /* lda = */ n, ws.w.data(), ws.work, ws.iwork);
  } else {
    syevd(n, z, /* lda = */ n, ws.w.data(), ws.work, ws.iwork);
  }
  // LAPACK's order is ascending; an infinite eigenvalue (float32 overflow) fails the attempt.
  for (std::size_t j = 0; j < nn; ++j) ws.values[j] = scale * static_cast<double>(ws.w[nn - 1 - j]);
  if (!all_within(ws.values.data(), nn)) return false;
  for (std::size_t j = 0; j < nn / 2; ++j) std::swap_ranges(z + j * nn, z + (j + 1) * nn, z + (nn - 1 - j) * nn);
  return all_within(z, nn * nn);
}

// SOAP's refresh of A from Q_prev, both n x n in torch's row-major layout (a row-major matrix is its
// transpose to column-major BLAS, so no transposing copy is needed): Q (column-major) in ws.factor,
// estimates in ws.values and the permutation in ws.order; a skipped refresh leaves ws.factor alone.
// Returns false when the result is not finite.
template <typename T>
bool compute_refresh(int n, const T* a, const T* q_prev, double scale, double skip_tol, Workspace<T>& ws,
                     BasisReport& report) {
  const std::size_t nn = static_cast<std::size_t>(n);
  grow(ws.product, nn * nn);
  grow(ws.est, nn);
  grow(ws.values, nn);
  grow(ws.order, nn);
  // T = scale A Q_prev, kept row-major: as column-major it is T^T = Q_prev^T A^T, the product of the
  // two inputs as BLAS sees them.
  T* t = ws.product.data();
  gemm(false, false, n, n, n, /* alpha = */ static_cast<T>(scale), q_prev, /* lda = */ n, a, /* ldb = */ n,
       /* beta = */ T(0), t, /* ldc = */ n);
  // est_j = sum_i Q_prev(i, j) T(i, j), row by row (contiguous, vectorized), in double.
  std::fill(ws.est.begin(), ws.est.begin() + n, 0.0);
  double* est = ws.est.data();
  for (std::size_t i = 0; i < nn; ++i) {
    const T* q_row = q_prev + i * nn;
    const T* t_row = t + i * nn;
    for (std::size_t j = 0; j < nn; ++j) est[j] += static_cast<double>(q_row[j]) * static_cast<double>(t_row[j]);
  }
  // A NaN estimate would also break the sort's strict weak order.
  if (!all_within(ws.est.data(), nn)) return false;
  std::iota(ws.order.begin(), ws.order.begin() + n, 0);

  if (skip_tol > 0) {
    grow(ws.gram, nn * nn);
    T* m = ws.gram.data();  // M = Q_prev^T T; its diagonal and off-diagonal sums do not depend on layout
    gemm(false, true, n, n, n, /* alpha = */ T(1), q_prev, /* lda = */ n, t, /* ldb = */ n, /* beta = */ T(0), m,
         /* ldc = */ n);
    double off = 0, diagonal = 0;
    for (std::size_t j = 0; j < nn; ++j) {
      for (std::size_t i = 0; i < nn; ++i) {
        const double x = m[i + j * nn];
        (i == j ? diagonal : off) += x * x;
      }
    }
    if (!std::isfinite(off + diagonal)) return false;
    report.off_diagonal_ratio = off + diagonal > 0 ? std::sqrt(off / (off + diagonal)) : 0.0;
    if (report.off_diagonal_ratio <= skip_tol) {
      report.skipped = true;
      std::copy(ws.est.begin(), ws.est.begin() + n, ws.values.begin());
      return true;
    }
  }

  std::stable_sort(ws.order.begin(), ws.order.begin() + n, [&](int x, int y) { return ws.est[x] > ws.est[y]; });
  for (std::size_t j = 0; j < nn; ++j) ws.values[j] = ws.est[static_cast<std::size_t>(ws.order[j])];
  // T's columns in that order, column-major, for the QR: a transposing gather of the row-major T.
  grow(ws.factor, nn * nn);
  transpose(n, t, ws.factor.data(), ws.order.data());
  qr_q(n, n, ws.factor.data(), /* lda = */ n, ws.work);
  return all_within(ws.factor.data(), nn * nn);
}

// Runs `attempt(ws, report)` in float32 and, if it throws NumericalError or returns a failure
// message, again in float64 (Out = float); in float64 only for Out = double. `store(ws, report)`
// writes the outputs of the attempt that succeeded.
template <typename Out, typename Attempt, typename Store>
BasisReport with_float64_retry(const char* routine, Attempt attempt, Store store) {
  auto run = [&](auto& ws, BasisReport& report) -> std::string {
    try {
      return attempt(ws, report);
    } catch (const NumericalError& error) {
      return error.what();
    }
  };
  std::string float32_failure;
  if constexpr (std::is_same_v<Out, float>) {
    BasisReport report;
    Workspace<float>& ws = workspace<float>();
    float32_failure = run(ws, report);
    if (float32_failure.empty()) {
      store(ws, report);
      return report;
    }
  }
  // float32 ran out of range or LAPACK gave up; float64 has 8 more exponent bits and 29 more
  // mantissa bits, and the result must still fit the output type.
  BasisReport report;
  report.used_float64 = true;
  Workspace<double>& ws = workspace<double>();
  const std::string float64_failure = run(ws, report);
  if (float64_failure.empty()) {
    store(ws, report);
    return report;
  }
  if constexpr (std::is_same_v<Out, float>) {
    throw NumericalError(std::string("[") + routine + "] float32 attempt failed (" + float32_failure +
                         "); float64 retry failed (" + float64_failure + ")");
  } else {
    throw NumericalError(std::string("[") + routine + "] " + float64_failure);
  }
}

template <typename Out>
BasisReport eigenbasis_impl(int n, const Out* a, Out* q, Out* values, double scale) {
  check_arguments("eigenbasis", n, a != nullptr && q != nullptr && values != nullptr, scale, /* skip_tol = */ 0);
  if (n == 0) return BasisReport{};
  require_finite_input("eigenbasis", "a", n, a);
  const std::size_t nn = static_cast<std::size_t>(n);
  if (std::all_of(a, a + nn * nn, [](Out x) { return x == Out(0); })) {
    std::fill(q, q + nn * nn, Out(0));
    for (std::size_t i = 0; i < nn; ++i) q[i * nn + i] = Out(1);
    std::fill(values, values + nn, Out(0));
    return BasisReport{};
  }
  auto attempt = [&](auto& ws, BasisReport&) -> std::string {
    using T = typename std::decay_t<decltype(ws.a)>::value_type;
    grow(ws.a, nn * nn);
    transpose(n, a, ws.a.data());
    if (!compute_eigenbasis(n, scale, ws)) return non_finite_result(n, scale);
    if (!all_within<double, Out>(ws.values.data(), nn) || !all_within<T, Out>(ws.a.data(), nn * nn)) {
      return "result overflows the output type, " + non_finite_result(n, scale);
    }
    return {};
  };
  auto store = [&](const auto& ws, const BasisReport&) {
    transpose(n, ws.a.data(), q);
    std::transform(ws.values.begin(), ws.values.begin() + n, values, [](double x) { return static_cast<Out>(x); });
  };
  return with_float64_retry<Out>("eigenbasis", attempt, store);
}

template <typename Out>
BasisReport qr_refresh_impl(int n, const Out* a, const Out* q_prev, Out* q, Out* estimates, Out* perm, double scale,
                            double skip_tol) {
  check_arguments("qr_refresh", n,
                  a != nullptr && q_prev != nullptr && q != nullptr && estimates != nullptr && perm != nullptr, scale,
                  skip_tol);
  if (n == 0) return BasisReport{};
  require_finite_input("qr_refresh", "a", n, a);
  require_finite_input("qr_refresh", "q_prev", n, q_prev);
  const std::size_t nn = static_cast<std::size_t>(n);
  auto attempt = [&](auto& ws, BasisReport& report) -> std::string {
    using T = typename std::decay_t<decltype(ws.a)>::value_type;
    // The inputs as they are in the attempt's precision (converted copies for the float64 retry).
    const T* a_in = as_precision(a, nn * nn, ws.a);
    const T* q_prev_in = as_precision(q_prev, nn * nn, ws.basis);
    if (!compute_refresh(n, a_in, q_prev_in, scale, skip_tol, ws, report)) return non_finite_result(n, scale);
    if (!all_within<double, Out>(ws.values.data(), nn) ||
        (!report.skipped && !all_within<T, Out>(ws.factor.data(), nn * nn))) {
      return "result overflows the output type, " + non_finite_result(n, scale);
    }
    return {};
  };
  auto store = [&](const auto& ws, const BasisReport& report) {
    if (!report.skipped) {
      transpose(n, ws.factor.data(), q);
    } else if (q != q_prev) {
      std::copy(q_prev, q_prev + nn * nn, q);
    }
    for (std::size_t j = 0; j < nn; ++j) {
      estimates[j] = static_cast<Out>(ws.values[j]);
      perm[j] = static_cast<Out>(ws.order[j]);
    }
  };
  return with_float64_retry<Out>("qr_refresh", attempt, store);
}

}  // namespace

BasisReport eigenbasis(int n, const float* a, float* q, float* values, double scale) {
  return eigenbasis_impl(n, a, q, values, scale);
}

BasisReport eigenbasis(int n, const double* a, double* q, double* values, double scale) {
  return eigenbasis_impl(n, a, q, values, scale);
}

bool is_identity(int n, const float* q) {
  const std::size_t nn = static_cast<std::size_t>(n);
  for (std::size_t i = 0; i < nn; ++i) {
    for (std::size_t j = 0; j < nn; ++j) {
      if (q[i * nn + j] != (i == j ? 1.0f : 0.0f)) return false;
    }
  }
  return true;
}

BasisReport qr_refresh(int n, const float* a, const float* q_prev, float* q, float* estimates, float* perm,
                       double scale, double skip_tol) {
  return qr_refresh_impl(n, a, q_prev, q, estimates, perm, scale, skip_tol);
}

BasisReport qr_refresh(int n, const double* a, const double* q_prev, double* q, double* estimates, double* perm,
                       double scale, double skip_tol) {
  return qr_refresh_impl(n, a, q_prev, q, estimates, perm, scale, skip_tol);
}

}  // namespace asteria::linalg
