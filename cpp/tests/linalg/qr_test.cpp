// The in-house Householder QR (qr.cpp) against LAPACK's xGEQRF + xORGQR and from its definition.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <random>
#include <utility>
#include <vector>

#include "asteria/common/errors.h"
#include "asteria/linalg/qr.h"

extern "C" {
void dgeqrf_(const int* m, const int* n, double* a, const int* lda, double* tau, double* work, const int* lwork,
             int* info);
void dorgqr_(const int* m, const int* n, const int* k, double* a, const int* lda, const double* tau, double* work,
             const int* lwork, int* info);
}

namespace asteria::linalg {
namespace {

template <typename T>
std::vector<T> gaussian(int m, int n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal;
  std::vector<T> a(static_cast<std::size_t>(m) * n);
  for (T& x : a) x = static_cast<T>(normal(rng));
  return a;
}

// (m, n): one panel, exactly one panel (128), just past it, several, and tall matrices.
class QrQ : public ::testing::TestWithParam<std::pair<int, int>> {};

// Q^T Q = I, and Q^T A upper triangular (so Q's first j columns span A's first j: the QR's Q, up to
// column signs) with |R| reproducing A; in float64 against tight bounds, in float32 against loose ones.
template <typename T>
void check_orthonormal_triangular(int m, int n, const std::vector<T>& a, const std::vector<T>& q, double tolerance) {
  auto dot = [&](const std::vector<T>& x, int i, const std::vector<T>& y, int j) {
    double sum = 0;
    for (int k = 0; k < m; ++k) sum += static_cast<double>(x[k + static_cast<std::size_t>(i) * m]) * y[k + static_cast<std::size_t>(j) * m];
    return sum;
  };
  double orthogonality = 0, below = 0, scale = 0;
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < n; ++i) {
      orthogonality = std::max(orthogonality, std::abs(dot(q, i, q, j) - (i == j ? 1.0 : 0.0)));
      const double r = dot(q, i, a, j);  // R = Q^T A
      if (i > j) below = std::max(below, std::abs(r));
      scale = std::max(scale, std::abs(r));
    }
  }
  EXPECT_LT(orthogonality, tolerance) << m << " x " << n;
  EXPECT_LT(below, tolerance * scale) << m << " x " << n;
}

template <typename T>
void check_qr_q(int m, int n, double tolerance) {
  const std::vector<T> a = gaussian<T>(m, n, static_cast<unsigned>(m * 1000 + n));
  std::vector<T> q = a, work;
  qr_q(m, n, q.data(), m, work);
  check_orthonormal_triangular(m, n, a, q, tolerance);
}

TEST_P(QrQ, OrthonormalAndTriangularInFloat64) { check_qr_q<double>(GetParam().first, GetParam().second, 1e-12); }

TEST_P(QrQ, OrthonormalAndTriangularInFloat32) { check_qr_q<float>(GetParam().first, GetParam().second, 2e-4); }

INSTANTIATE_TEST_SUITE_P(Shapes, QrQ,
                         ::testing::Values(std::pair{1, 1}, std::pair{30, 12}, std::pair{128, 128},
                                           std::pair{130, 130}, std::pair{300, 300}, std::pair{400, 257}));

TEST(LapackShim, QrQRejectsBadShapes) {
  std::vector<float> a(16), work;
  EXPECT_THROW(qr_q(2, 3, a.data(), 2, work), InvalidArgument);
  EXPECT_THROW(qr_q(4, 4, a.data(), 3, work), InvalidArgument);
  EXPECT_THROW(qr_q(4, -1, a.data(), 4, work), InvalidArgument);
}

// LAPACK's own Q, signs included: the panels' reflectors are xGEQRF's.
std::vector<double> lapack_q(int m, int n, std::vector<double> a) {
  std::vector<double> tau(static_cast<std::size_t>(n));
  int info = 0, lwork = -1;
  double query = 0;
  dgeqrf_(&m, &n, a.data(), &m, tau.data(), &query, &lwork, &info);
  std::vector<double> work(static_cast<std::size_t>(query) + 1);
  lwork = static_cast<int>(work.size());
  dgeqrf_(&m, &n, a.data(), &m, tau.data(), work.data(), &lwork, &info);
  EXPECT_EQ(info, 0);
  dorgqr_(&m, &n, &n, a.data(), &m, tau.data(), work.data(), &lwork, &info);
  EXPECT_EQ(info, 0);
  return a;
}

double max_difference(const std::vector<double>& x, const std::vector<double>& y) {
  double worst = 0;
  for (std::size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::abs(x[i] - y[i]));
  return worst;
}

TEST_P(QrQ, EqualsLapackGeqrfOrgqrSignsIncluded) {
  const auto [m, n] = GetParam();
  const std::vector<double> a = gaussian<double>(m, n, 7);
  std::vector<double> q = a, work;
  qr_q(m, n, q.data(), m, work);
  EXPECT_LT(max_difference(q, lapack_q(m, n, a)), 1e-11) << m << " x " << n;
}

// A leading dimension above m (a block of a larger matrix) gives the same Q, and leaves the padding alone.
TEST(QrQLeadingDimension, PaddedRowsGiveTheSameQ) {
  const int m = 300, n = 200, lda = 311;
  const std::vector<double> a = gaussian<double>(m, n, 17);
  std::vector<double> q = a, work;
  qr_q(m, n, q.data(), m, work);
  std::vector<double> padded(static_cast<std::size_t>(lda) * n, 7.0);
  for (int j = 0; j < n; ++j) {
    std::copy(a.begin() + static_cast<std::ptrdiff_t>(j) * m, a.begin() + static_cast<std::ptrdiff_t>(j + 1) * m,
              padded.begin() + static_cast<std::ptrdiff_t>(j) * lda);
  }
  qr_q(m, n, padded.data(), lda, work);
  double worst = 0;
  bool padding_kept = true;
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < lda; ++i) {
      const double got = padded[static_cast<std::size_t>(j) * lda + i];
      if (i < m) worst = std::max(worst, std::abs(got - q[static_cast<std::size_t>(j) * m + i]));
      else padding_kept &= got == 7.0;
    }
  }
  EXPECT_LT(worst, 1e-13);
  EXPECT_TRUE(padding_kept);
}

// Zero columns give reflectors with tau = 0 (H = I), in inner panels, at panel edges and last: Q is
// still LAPACK's.
TEST(QrQRankDeficient, ZeroColumnsMatchLapack) {
  const int m = 300, n = 260;
  std::vector<double> a = gaussian<double>(m, n, 11);
  for (int j : {0, 5, 31, 32, 127, 128, 131, 259}) {
    std::fill(a.begin() + static_cast<std::ptrdiff_t>(j) * m, a.begin() + static_cast<std::ptrdiff_t>(j + 1) * m, 0.0);
  }
  std::vector<double> q = a, work;
  qr_q(m, n, q.data(), m, work);
  EXPECT_LT(max_difference(q, lapack_q(m, n, a)), 1e-11);
}

// A repeated column leaves only rounding noise to reflect, so that column of Q is not unique; Q must
// still be finite, orthonormal and triangularize A.
TEST(QrQRankDeficient, RepeatedColumnsStayOrthonormal) {
  const int m = 300, n = 260;
  std::vector<float> a = gaussian<float>(m, n, 13);
  for (int j : {40, 129, 200}) std::copy(a.begin() + 3 * m, a.begin() + 4 * m, a.begin() + static_cast<std::ptrdiff_t>(j) * m);
  std::vector<float> q = a, work;
  qr_q(m, n, q.data(), m, work);
  EXPECT_TRUE(std::all_of(q.begin(), q.end(), [](float x) { return std::isfinite(x); }));
  check_orthonormal_triangular(m, n, a, q, 2e-4);
}

}  // namespace
}  // namespace asteria::linalg
