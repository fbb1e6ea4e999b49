#include "asteria/linalg/inverse_root.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "asteria/common/errors.h"
#include "asteria/linalg/detail.h"
#include "asteria/linalg/lapack.h"

namespace asteria::linalg {
namespace {

using detail::all_within;
using detail::grow;

void require_finite_number(bool ok, const char* field, double value, const char* rule) {
  if (!ok) {
    throw InvalidArgument(std::string("Invalid ") + field + "=" + format_number(value) + ": must be a finite number " +
                          rule);
  }
}

void require_leading_dim(const char* what, int ld, int n) {
  if (ld < std::max(1, n)) {
    throw InvalidArgument(std::string("[inverse_root] Invalid ") + what + "=" + std::to_string(ld) +
                          ": must be >= max(1, n=" + std::to_string(n) + ")");
  }
}

template <typename T>
void check_arguments(int n, const T* a, int lda, const T* out, int ldo, const RootSpec& spec) {
  validate(spec);
  if (n < 0) throw InvalidArgument("[inverse_root] Invalid n=" + std::to_string(n) + ": must be >= 0");
  require_leading_dim("lda", lda, n);
  require_leading_dim("ldo", ldo, n);
  if (n > 0 && (a == nullptr || out == nullptr)) {
    throw InvalidArgument("[inverse_root] Invalid null matrix pointer for n=" + std::to_string(n));
  }
}

// Per-thread buffers, grown to the largest n seen and kept: a refresh worker computes roots of
// the same few shapes over and over, and reusing the pages avoids a malloc plus page faults on
// tens of megabytes per call.
template <typename T>
struct Workspace {
  std::vector<T> matrix;  // input copy (the eigensolver overwrites it), then scaled eigenvectors
  std::vector<T> eigenvalues;
  std::vector<T> work;  // eigensolver workspace; afterwards the lower triangle of the result
  std::vector<int> iwork;
};

template <typename T>
Workspace<T>& workspace() {
  thread_local Workspace<T> ws;
  return ws;
}

// Copies (and converts) the n x n matrix `a` into ws.matrix with leading dimension n; throws on
// the first non-finite entry.
template <typename T, typename In>
void load(int n, const In* a, int lda, Workspace<T>& ws) {
  const std::size_t nn = static_cast<std::size_t>(n);
  grow(ws.matrix, nn * nn);
  grow(ws.eigenvalues, nn);
  for (std::size_t j = 0; j < nn; ++j) {
    const In* column = a + j * static_cast<std::size_t>(lda);
    if (!all_within(column, nn)) {
      const std::size_t i = static_cast<std::size_t>(std::find_if_not(column, column + nn, [](In x) {
                                                       return std::isfinite(x);
                                                     }) -
                                                     column);
      throw NumericalError("[inverse_root] non-finite input a(" + std::to_string(i) + ", " + std::to_string(j) +
                           ")=" + format_number(column[i]) + " (n=" + std::to_string(n) + ")");
    }
    std::copy(column, column + nn, ws.matrix.data() + j * nn);
  }
}

// Computes the root of the matrix loaded into ws.matrix; the lower triangle of the result (n x n,
// leading dimension n) lands in ws.work. Returns false when the result is not finite.
template <typename T>
bool compute_root(int n, const RootSpec& spec, Workspace<T>& ws, RootReport& report) {
  T* q = ws.matrix.data();
  T* w = ws.eigenvalues.data();
  // float32 takes the restructured eigh (the throughput path); float64, the retry, takes LAPACK's
  // own xSYEVD so that a failure of one code path is retried by another.
  if constexpr (std::is_same_v<T, float>) {
    eigh(n, q, /* lda = */ n, w, ws.work, ws.iwork);
  } else {
    syevd(n, q, /* lda = */ n, w, ws.work, ws.iwork);
  }

  // The eigenvalues are ascending. An infinite one (float32 overflow) would turn into a zero of
  // the root and pass the finiteness check below, so it fails the attempt here.
  report.lambda_min = spec.scale * static_cast<double>(w[0]);
  report.lambda_max = spec.scale * static_cast<double>(w[n - 1]);
  if (!all_within(w, static_cast<std::size_t>(n))) return false;
  // The transform runs in double so that eps survives next to float32 eigenvalues, and adds the
  // offset before eps so that the smallest eigenvalue becomes exactly the ridge, not 0 after round-off.
  const double offset = std::max(0.0, -report.lambda_min);
  const double ridge = spec.eps + spec.relative_eps * (report.lambda_max + offset);
  const double half_exponent = spec.exponent / 2;

  // root = Q diag(lambda'^p) Q^T = B B^T with B = Q diag(lambda'^(p/2)): syrk forms only the lower
  // triangle of B B^T, n^3 flops where a gemm with Q^T would take 2 n^3.
  const std::size_t nn = static_cast<std::size_t>(n);
  for (std::size_t j = 0; j < nn; ++j) {
    const double regularized = (spec.scale * static_cast<double>(w[j]) + offset) + ridge;
    const T d = static_cast<T>(std::pow(regularized, half_exponent));
    T* column = q + j * nn;
    for (std::size_t i = 0; i < nn; ++i) column[i] *= d;
  }
  grow(ws.work, nn * nn);
  T* result = ws.work.data();
  syrk_lower(n, /* k = */ n, /* alpha = */ T(1), q, /* lda = */ n, /* beta = */ T(0), result, /* ldc = */ n);
  for (std::size_t j = 0; j < nn; ++j) {
    if (!all_within(result + j * nn + j, nn - j)) return false;
  }
  return true;
}

// Writes the full symmetric matrix whose lower triangle is `lower` (leading dimension n) into
// `out`, converting to its type; the upper triangle is read transposed, in cache-sized tiles.
template <typename From, typename To>
void store_symmetric(int n, const From* lower, To* out, int ldo) {
  constexpr int kTile = 64;
  const std::size_t nn = static_cast<std::size_t>(n), ld = static_cast<std::size_t>(ldo);
  for (int jb = 0; jb < n; jb += kTile) {
    const int j_end = std::min(jb + kTile, n);
    for (int ib = 0; ib < jb; ib += kTile) {  // tiles above the diagonal: out(i, j) = lower(j, i)
      for (int j = jb; j < j_end; ++j) {
        for (int i = ib; i < ib + kTile; ++i) out[i + j * ld] = static_cast<To>(lower[j + i * nn]);
      }
    }
    for (int j = jb; j < j_end; ++j) {  // the diagonal tile's upper part, then everything below
      for (int i = jb; i < j; ++i) out[i + j * ld] = static_cast<To>(lower[j + i * nn]);
      std::transform(lower + j + j * nn, lower + (j + 1) * nn, out + j + j * ld,
                     [](From x) { return static_cast<To>(x); });
    }
  }
}

std::string non_finite_result(int n, const RootSpec& spec, const RootReport& report) {
  return "non-finite result (n=" + std::to_string(n) + ", exponent=" + format_number(spec.exponent) +
         ", eps=" + format_number(spec.eps) + ", relative_eps=" + format_number(spec.relative_eps) +
         ", lambda in [" + format_number(report.lambda_min) + ", " +
         format_number(report.lambda_max) + "])";
}

}  // namespace

void validate(const RootSpec& spec) {
  require_finite_number(std::isfinite(spec.exponent) && spec.exponent < 0, "exponent", spec.exponent, "< 0");
  require_finite_number(std::isfinite(spec.eps) && spec.eps > 0, "eps", spec.eps, "> 0");
  require_finite_number(std::isfinite(spec.relative_eps) && spec.relative_eps >= 0, "relative_eps", spec.relative_eps,
                        ">= 0");
  require_finite_number(std::isfinite(spec.scale) && spec.scale > 0, "scale", spec.scale, "> 0");
}

RootReport inverse_root(int n, const float* a, int lda, float* out, int ldo, const RootSpec& spec) {
  check_arguments(n, a, lda, out, ldo, spec);
  RootReport report;
  if (n == 0) return report;

  std::string float32_failure;
  Workspace<float>& ws = workspace<float>();
  load(n, a, lda, ws);
  try {
    if (compute_root(n, spec, ws, report)) {
      store_symmetric(n, ws.work.data(), out, ldo);
      return report;
    }
    float32_failure = non_finite_result(n, spec, report);
  } catch (const NumericalError& error) {
    float32_failure = error.what();
  }

  // float32 ran out of range or LAPACK gave up; float64 has 8 more exponent bits and 29 more
  // mantissa bits, and the result must still fit back into float32.
  Workspace<double>& ws64 = workspace<double>();
  load(n, a, lda, ws64);
  report = RootReport{};
  report.used_float64 = true;
  std::string float64_failure;
  try {
    if (!compute_root(n, spec, ws64, report)) float64_failure = non_finite_result(n, spec, report);
  } catch (const NumericalError& error) {
    float64_failure = error.what();
  }
  const double* lower = ws64.work.data();
  const std::size_t nn = static_cast<std::size_t>(n);
  if (float64_failure.empty()) {
    for (std::size_t j = 0; j < nn; ++j) {
      if (!all_within<double, float>(lower + j * nn + j, nn - j)) {
        float64_failure = "result overflows float32, " + non_finite_result(n, spec, report);
        break;
      }
    }
  }
  if (!float64_failure.empty()) {
    throw NumericalError("[inverse_root] float32 attempt failed (" + float32_failure + "); float64 retry failed (" +
                         float64_failure + ")");
  }
  store_symmetric(n, lower, out, ldo);
  return report;
}

RootReport inverse_root(int n, const double* a, int lda, double* out, int ldo, const RootSpec& spec) {
  check_arguments(n, a, lda, out, ldo, spec);
  RootReport report;
  report.used_float64 = true;
  if (n == 0) return report;

  Workspace<double>& ws = workspace<double>();
  load(n, a, lda, ws);
  if (!compute_root(n, spec, ws, report)) {
    throw NumericalError("[inverse_root] " + non_finite_result(n, spec, report));
  }
  store_symmetric(n, ws.work.data(), out, ldo);
  return report;
}

}  // namespace asteria::linalg
