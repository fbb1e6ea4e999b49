// Eigenbases and SOAP's QR refresh checked against references that share no code with LAPACK: a
// cyclic Jacobi eigensolver and a modified Gram-Schmidt QR in double, written here. Matrices are
// row-major n x n as torch lays them out: m[i * n + j] is component i of column vector j.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "asteria/common/errors.h"
#include "asteria/linalg/eigenbasis.h"
#include "jacobi_reference.h"

namespace asteria::linalg {
namespace {

using Matrix = std::vector<double>;

double& at(Matrix& m, int n, int i, int j) { return m[static_cast<std::size_t>(i) * n + j]; }
double at(const Matrix& m, int n, int i, int j) { return m[static_cast<std::size_t>(i) * n + j]; }

Matrix identity(int n) {
  Matrix m(static_cast<std::size_t>(n) * n, 0.0);
  for (int i = 0; i < n; ++i) at(m, n, i, i) = 1.0;
  return m;
}

Matrix multiply(const Matrix& a, const Matrix& b, int n, bool transpose_a = false) {
  Matrix c(a.size(), 0.0);
  for (int i = 0; i < n; ++i) {
    for (int k = 0; k < n; ++k) {
      const double aik = transpose_a ? at(a, n, k, i) : at(a, n, i, k);
      for (int j = 0; j < n; ++j) at(c, n, i, j) += aik * at(b, n, k, j);
    }
  }
  return c;
}

double column_dot(const Matrix& a, int ja, const Matrix& b, int jb, int n) {
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += at(a, n, i, ja) * at(b, n, i, jb);
  return sum;
}

double frobenius(const Matrix& m) {
  double sum = 0;
  for (double x : m) sum += x * x;
  return std::sqrt(sum);
}

// The shared Jacobi reference (jacobi_reference.h) on this file's layout.
void jacobi_eigen(int n, const Matrix& a, std::vector<double>& w, Matrix& v) {
  reference::jacobi_eigen(n, a, w, v,
                          [](Matrix& m, int size, int i, int j) -> double& { return at(m, size, i, j); });
}

// Modified Gram-Schmidt on the columns of p: the Q of p = Q R with R's diagonal positive.
Matrix gram_schmidt(int n, Matrix p) {
  for (int j = 0; j < n; ++j) {
    for (int k = 0; k < j; ++k) {
      const double r = column_dot(p, k, p, j, n);
      for (int i = 0; i < n; ++i) at(p, n, i, j) -= r * at(p, n, i, k);
    }
    const double norm = std::sqrt(column_dot(p, j, p, j, n));
    for (int i = 0; i < n; ++i) at(p, n, i, j) /= norm;
  }
  return p;
}

Matrix random_orthogonal(int n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal;
  Matrix g(static_cast<std::size_t>(n) * n);
  for (double& x : g) x = normal(rng);
  return gram_schmidt(n, g);
}

// V diag(eigenvalues) V^T for a random orthogonal V.
Matrix with_spectrum(const std::vector<double>& eigenvalues, const Matrix& v) {
  const int n = static_cast<int>(eigenvalues.size());
  Matrix a(static_cast<std::size_t>(n) * n, 0.0);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      double sum = 0;
      for (int k = 0; k < n; ++k) sum += at(v, n, i, k) * eigenvalues[k] * at(v, n, j, k);
      at(a, n, i, j) = sum;
    }
  }
  return a;
}

// G G^T / cols + shift I with G n x cols Gaussian.
Matrix gram(int n, int cols, double shift, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal;
  std::vector<double> g(static_cast<std::size_t>(n) * cols);
  for (double& x : g) x = normal(rng);
  Matrix a(static_cast<std::size_t>(n) * n, 0.0);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      double sum = 0;
      const double* gi = g.data() + static_cast<std::size_t>(i) * cols;
      const double* gj = g.data() + static_cast<std::size_t>(j) * cols;
      for (int k = 0; k < cols; ++k) sum += gi[k] * gj[k];
      at(a, n, i, j) = sum / cols + (i == j ? shift : 0.0);
    }
  }
  return a;
}

std::vector<double> spread_spectrum(int n, double low, double high) {
  std::vector<double> w(n);
  for (int k = 0; k < n; ++k) w[k] = low + (high - low) * k / std::max(1, n - 1);
  return w;
}

std::vector<float> to_float(const Matrix& m) { return std::vector<float>(m.begin(), m.end()); }
Matrix to_double(const std::vector<float>& m) { return Matrix(m.begin(), m.end()); }

// What qr_refresh computes, from the math, in double.
struct Refresh {
  Matrix q;
  std::vector<double> estimates;
  std::vector<int> perm;
};

Refresh reference_refresh(int n, const Matrix& a, const Matrix& q_prev, double scale) {
  Matrix t = multiply(a, q_prev, n);
  for (double& x : t) x *= scale;
  std::vector<double> est(n);
  for (int j = 0; j < n; ++j) est[j] = column_dot(q_prev, j, t, j, n);
  Refresh out;
  out.perm.resize(n);
  std::iota(out.perm.begin(), out.perm.end(), 0);
  std::stable_sort(out.perm.begin(), out.perm.end(), [&](int x, int y) { return est[x] > est[y]; });
  Matrix p(t.size());
  for (int j = 0; j < n; ++j) {
    out.estimates.push_back(est[out.perm[j]]);
    for (int i = 0; i < n; ++i) at(p, n, i, j) = at(t, n, i, out.perm[j]);
  }
  out.q = gram_schmidt(n, p);
  return out;
}

// Largest difference between the columns of `actual` and `expected` after flipping each column of
// `expected` to the sign of `actual`'s (QR and eigenvectors are unique up to column signs).
double max_column_difference(int n, const Matrix& actual, const Matrix& expected) {
  double worst = 0;
  for (int j = 0; j < n; ++j) {
    const double sign = column_dot(actual, j, expected, j, n) >= 0 ? 1.0 : -1.0;
    for (int i = 0; i < n; ++i) worst = std::max(worst, std::abs(at(actual, n, i, j) - sign * at(expected, n, i, j)));
  }
  return worst;
}

double orthonormality_error(int n, const Matrix& q) {
  Matrix qtq = multiply(q, q, n, /*transpose_a=*/true);
  for (int i = 0; i < n; ++i) at(qtq, n, i, i) -= 1.0;
  return frobenius(qtq);
}

double off_diagonal_ratio(int n, const Matrix& a, const Matrix& q) {
  const Matrix m = multiply(q, multiply(a, q, n), n, /*transpose_a=*/true);
  double off = 0;
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) off += i != j ? at(m, n, i, j) * at(m, n, i, j) : 0.0;
  }
  return std::sqrt(off) / frobenius(m);
}

struct FloatRefresh {
  std::vector<float> q, estimates, perm;
  BasisReport report;
};

FloatRefresh run_refresh(int n, const std::vector<float>& a, const std::vector<float>& q_prev, double scale,
                         double skip_tol) {
  FloatRefresh out{std::vector<float>(q_prev.size()), std::vector<float>(n), std::vector<float>(n), {}};
  out.report = qr_refresh(n, a.data(), q_prev.data(), out.q.data(), out.estimates.data(), out.perm.data(), scale,
                          skip_tol);
  return out;
}

TEST(Eigenbasis, MatchesJacobiSortedDescending) {
  constexpr int kN = 24;
  constexpr double kScale = 2.5;
  const Matrix a = gram(kN, 3 * kN, 0.1, 7);
  std::vector<float> q(kN * kN), values(kN);
  const BasisReport report = eigenbasis(kN, to_float(a).data(), q.data(), values.data(), kScale);
  EXPECT_FALSE(report.used_float64);
  EXPECT_FALSE(report.skipped);

  std::vector<double> w;
  Matrix v;
  jacobi_eigen(kN, a, w, v);
  std::sort(w.begin(), w.end(), std::greater<>());
  const double norm = kScale * w[0];
  for (int j = 0; j < kN; ++j) {
    EXPECT_NEAR(values[j], kScale * w[j], 1e-5 * norm) << "eigenvalue " << j;
    if (j > 0) EXPECT_GE(values[j - 1], values[j]);
  }
  // (scale A) Q = Q diag(values), column by column.
  const Matrix qd = to_double(q);
  const Matrix aq = multiply(a, qd, kN);
  double residual = 0;
  for (int i = 0; i < kN; ++i) {
    for (int j = 0; j < kN; ++j) {
      residual = std::max(residual, std::abs(kScale * at(aq, kN, i, j) - values[j] * at(qd, kN, i, j)));
    }
  }
  EXPECT_LT(residual, 1e-5 * norm);
  EXPECT_LT(orthonormality_error(kN, qd), 1e-5);
}

TEST(Eigenbasis, ZeroMatrixGetsTheIdentityAndZeroValues) {
  constexpr int kN = 6;
  const std::vector<float> zero(kN * kN, 0.0f);
  std::vector<float> q(kN * kN, 7.0f), values(kN, 7.0f);
  eigenbasis(kN, zero.data(), q.data(), values.data(), 3.0);
  EXPECT_TRUE(is_identity(kN, q.data()));
  for (const float v : values) EXPECT_EQ(v, 0.0f);
  // A nonzero diagonal factor with ascending entries is not left as the identity: its basis reverses.
  std::vector<float> diagonal(kN * kN, 0.0f);
  for (int i = 0; i < kN; ++i) diagonal[i * kN + i] = static_cast<float>(i + 1);
  eigenbasis(kN, diagonal.data(), q.data(), values.data(), 1.0);
  EXPECT_FALSE(is_identity(kN, q.data()));
  EXPECT_EQ(values[0], static_cast<float>(kN));
  q[1] = 1e-30f;  // one off-diagonal entry makes any matrix not the identity
  EXPECT_FALSE(is_identity(kN, q.data()));
}

TEST(Eigenbasis, Float64OverloadMatchesJacobiClosely) {
  constexpr int kN = 12;
  const Matrix v = random_orthogonal(kN, 3);
  const std::vector<double> spectrum = spread_spectrum(kN, 1.0, 12.0);
  const Matrix a = with_spectrum(spectrum, v);
  Matrix q(kN * kN);
  std::vector<double> values(kN);
  EXPECT_TRUE(eigenbasis(kN, a.data(), q.data(), values.data(), 1.0).used_float64);
  // Eigenvalue 12 - j belongs to v's column 11 - j.
  Matrix expected(q.size());
  for (int i = 0; i < kN; ++i) {
    for (int j = 0; j < kN; ++j) at(expected, kN, i, j) = at(v, kN, i, kN - 1 - j);
  }
  for (int j = 0; j < kN; ++j) EXPECT_NEAR(values[j], spectrum[kN - 1 - j], 1e-12);
  EXPECT_LT(max_column_difference(kN, q, expected), 1e-12);
}

TEST(QrRefresh, MatchesGramSchmidtReference) {
  constexpr int kN = 20;
  constexpr double kScale = 0.75;
  const Matrix a = with_spectrum(spread_spectrum(kN, 1.0, 10.0), random_orthogonal(kN, 11));
  const Matrix q_prev = random_orthogonal(kN, 12);
  const Refresh expected = reference_refresh(kN, a, q_prev, kScale);

  const FloatRefresh actual = run_refresh(kN, to_float(a), to_float(q_prev), kScale, 0.0);
  EXPECT_FALSE(actual.report.used_float64);
  EXPECT_FALSE(actual.report.skipped);
  EXPECT_EQ(actual.report.off_diagonal_ratio, -1);
  for (int j = 0; j < kN; ++j) {
    EXPECT_EQ(actual.perm[j], static_cast<float>(expected.perm[j])) << j;
    EXPECT_NEAR(actual.estimates[j], expected.estimates[j], 1e-5 * 10);
  }
  EXPECT_LT(max_column_difference(kN, to_double(actual.q), expected.q), 1e-4);
  EXPECT_LT(orthonormality_error(kN, to_double(actual.q)), 1e-5);

  Matrix q64(q_prev.size());
  std::vector<double> estimates64(kN), perm64(kN);
  EXPECT_TRUE(qr_refresh(kN, a.data(), q_prev.data(), q64.data(), estimates64.data(), perm64.data(), kScale, 0.0)
                  .used_float64);
  EXPECT_LT(max_column_difference(kN, q64, expected.q), 1e-10);
  for (int j = 0; j < kN; ++j) EXPECT_EQ(perm64[j], expected.perm[j]);
}

TEST(QrRefresh, PermutesOutOfOrderColumnsIntoDescendingOrder) {
  constexpr int kN = 6;
  const Matrix e = random_orthogonal(kN, 5);
  const std::vector<double> spectrum = {6, 5, 4, 3, 2, 1};  // column k of e has eigenvalue 6 - k
  const Matrix a = with_spectrum(spectrum, e);
  const std::vector<int> shuffle = {3, 0, 5, 1, 4, 2};  // q_prev[:, j] = e[:, shuffle[j]]
  Matrix q_prev(e.size());
  for (int i = 0; i < kN; ++i) {
    for (int j = 0; j < kN; ++j) at(q_prev, kN, i, j) = at(e, kN, i, shuffle[j]);
  }
  const FloatRefresh actual = run_refresh(kN, to_float(a), to_float(q_prev), 1.0, 0.0);
  // est_j = 6 - shuffle[j]; sorted descending, column j of the result comes from the q_prev column
  // holding e[:, j].
  const std::vector<float> expected_perm = {1, 3, 5, 0, 4, 2};
  EXPECT_EQ(actual.perm, expected_perm);
  for (int j = 0; j < kN; ++j) EXPECT_NEAR(actual.estimates[j], spectrum[j], 1e-5);
  EXPECT_LT(max_column_difference(kN, to_double(actual.q), e), 1e-5);
}

TEST(QrRefresh, TiedEstimatesKeepTheLowerIndexFirst) {
  constexpr int kN = 4;
  Matrix a(kN * kN, 0.0);
  const double diagonal[kN] = {2, 1, 2, 1};
  for (int i = 0; i < kN; ++i) at(a, kN, i, i) = diagonal[i];
  const FloatRefresh actual = run_refresh(kN, to_float(a), to_float(identity(kN)), 1.0, 0.0);
  EXPECT_EQ(actual.perm, (std::vector<float>{0, 2, 1, 3}));
  EXPECT_EQ(actual.estimates, (std::vector<float>{2, 2, 1, 1}));
  // Q of the permuted identity columns (scaled): the permutation itself, up to signs.
  for (int j = 0; j < kN; ++j) EXPECT_EQ(std::abs(actual.q[static_cast<int>(actual.perm[j]) * kN + j]), 1.0f);
}

TEST(QrRefresh, RepeatedRefreshesConvergeToTheEigenbasis) {
  constexpr int kN = 8;
  std::vector<double> spectrum(kN);
  for (int k = 0; k < kN; ++k) spectrum[k] = std::pow(0.5, k);
  const Matrix e = random_orthogonal(kN, 21);
  const Matrix a = with_spectrum(spectrum, e);
  std::vector<float> q = to_float(random_orthogonal(kN, 22));
  const std::vector<float> af = to_float(a);
  double first_ratio = -1, last_ratio = -1;
  for (int iteration = 0; iteration < 40; ++iteration) {
    // A tiny skip_tol computes the ratio (of the basis going in) without ever skipping.
    FloatRefresh next = run_refresh(kN, af, q, 1.0, 1e-30);
    ASSERT_FALSE(next.report.skipped);
    if (iteration == 0) first_ratio = next.report.off_diagonal_ratio;
    last_ratio = next.report.off_diagonal_ratio;
    q = next.q;
  }
  // The ratio reported is that of the basis going in: the first one is the random start's.
  EXPECT_NEAR(first_ratio, off_diagonal_ratio(kN, a, random_orthogonal(kN, 22)), 1e-5);
  EXPECT_GT(first_ratio, 0.1);
  EXPECT_LT(last_ratio, 1e-4);
  EXPECT_LT(off_diagonal_ratio(kN, a, to_double(q)), 1e-4);
  EXPECT_LT(max_column_difference(kN, to_double(q), e), 1e-3);
}

TEST(QrRefresh, SkipsANearlyDiagonalBasisAndKeepsItBitForBit) {
  constexpr int kN = 10;
  const Matrix a = gram(kN, 4 * kN, 0.5, 31);
  const std::vector<float> af = to_float(a);
  std::vector<float> basis(kN * kN), values(kN);
  eigenbasis(kN, af.data(), basis.data(), values.data(), 1.0);

  const FloatRefresh skipped = run_refresh(kN, af, basis, 1.0, 1e-3);
  EXPECT_TRUE(skipped.report.skipped);
  EXPECT_GE(skipped.report.off_diagonal_ratio, 0.0);
  EXPECT_LE(skipped.report.off_diagonal_ratio, 1e-3);
  EXPECT_EQ(std::memcmp(skipped.q.data(), basis.data(), basis.size() * sizeof(float)), 0);
  for (int j = 0; j < kN; ++j) {
    EXPECT_EQ(skipped.perm[j], static_cast<float>(j));
    EXPECT_NEAR(skipped.estimates[j], values[j], 1e-5 * values[0]);
  }

  // In place: q may be q_prev.
  std::vector<float> in_place = basis, estimates(kN), perm(kN);
  EXPECT_TRUE(qr_refresh(kN, af.data(), in_place.data(), in_place.data(), estimates.data(), perm.data(), 1.0, 1e-3)
                  .skipped);
  EXPECT_EQ(in_place, basis);

  const FloatRefresh refreshed = run_refresh(kN, af, to_float(random_orthogonal(kN, 32)), 1.0, 1e-3);
  EXPECT_FALSE(refreshed.report.skipped);
  EXPECT_GT(refreshed.report.off_diagonal_ratio, 1e-3);
}

TEST(QrRefresh, UnsortedSkipEstimatesFollowQPrevOrder) {
  constexpr int kN = 3;
  Matrix a(kN * kN, 0.0);
  at(a, kN, 0, 0) = 1;
  at(a, kN, 1, 1) = 3;
  at(a, kN, 2, 2) = 2;
  const FloatRefresh skipped = run_refresh(kN, to_float(a), to_float(identity(kN)), 2.0, 1e-6);
  EXPECT_TRUE(skipped.report.skipped);
  EXPECT_EQ(skipped.report.off_diagonal_ratio, 0.0);
  EXPECT_EQ(skipped.estimates, (std::vector<float>{2, 6, 4}));
  EXPECT_EQ(skipped.perm, (std::vector<float>{0, 1, 2}));
}

TEST(EigenbasisGates, RejectNonFiniteInputAndLeaveOutputsUntouched) {
  constexpr int kN = 5;
  std::vector<float> a = to_float(gram(kN, 2 * kN, 0.1, 41));
  const std::vector<float> q_prev = to_float(random_orthogonal(kN, 42));
  const std::vector<float> sentinel(kN * kN, 7.0f);
  std::vector<float> q = sentinel, values(kN, 7.0f), perm(kN, 7.0f);

  a[2 * kN + 3] = NAN;
  try {
    eigenbasis(kN, a.data(), q.data(), values.data(), 1.0);
    FAIL() << "expected NumericalError";
  } catch (const NumericalError& e) {
    EXPECT_NE(std::string(e.what()).find("non-finite input a(2, 3)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(qr_refresh(kN, a.data(), q_prev.data(), q.data(), values.data(), perm.data(), 1.0, 0.0),
               NumericalError);
  a[2 * kN + 3] = 1.0f;
  std::vector<float> bad_basis = q_prev;
  bad_basis[4] = INFINITY;
  try {
    qr_refresh(kN, a.data(), bad_basis.data(), q.data(), values.data(), perm.data(), 1.0, 0.0);
    FAIL() << "expected NumericalError";
  } catch (const NumericalError& e) {
    EXPECT_NE(std::string(e.what()).find("non-finite input q_prev(0, 4)"), std::string::npos) << e.what();
  }
  EXPECT_EQ(q, sentinel);
  EXPECT_EQ(values, std::vector<float>(kN, 7.0f));
  EXPECT_EQ(perm, std::vector<float>(kN, 7.0f));
}

TEST(EigenbasisGates, ResultsBeyondFloat32FailAfterTheFloat64RetryAndWriteNothing) {
  constexpr int kN = 4;
  Matrix big = identity(kN);
  for (double& x : big) x *= 1e38;
  const std::vector<float> a = to_float(big);
  const std::vector<float> q_prev = to_float(identity(kN));
  const std::vector<float> sentinel(kN * kN, 7.0f);
  std::vector<float> q = sentinel, values(kN, 7.0f), perm(kN, 7.0f);
  try {
    eigenbasis(kN, a.data(), q.data(), values.data(), 1e10);
    FAIL() << "expected NumericalError";
  } catch (const NumericalError& e) {
    EXPECT_NE(std::string(e.what()).find("float64 retry failed"), std::string::npos) << e.what();
  }
  EXPECT_THROW(qr_refresh(kN, a.data(), q_prev.data(), q.data(), values.data(), perm.data(), 1e10, 0.0),
               NumericalError);
  EXPECT_EQ(q, sentinel);
  EXPECT_EQ(values, std::vector<float>(kN, 7.0f));
  EXPECT_EQ(perm, std::vector<float>(kN, 7.0f));
}

TEST(EigenbasisGates, RejectBadArguments) {
  std::vector<float> a(4, 1.0f), q(4), v(2), p(2);
  EXPECT_THROW(eigenbasis(-1, a.data(), q.data(), v.data(), 1.0), InvalidArgument);
  EXPECT_THROW(eigenbasis(2, a.data(), q.data(), v.data(), 0.0), InvalidArgument);
  EXPECT_THROW(eigenbasis(2, nullptr, q.data(), v.data(), 1.0), InvalidArgument);
  EXPECT_THROW(qr_refresh(2, a.data(), q.data(), q.data(), v.data(), p.data(), NAN, 0.0), InvalidArgument);
  EXPECT_THROW(qr_refresh(2, a.data(), q.data(), q.data(), v.data(), p.data(), 1.0, -1e-3), InvalidArgument);
  EXPECT_THROW(qr_refresh(2, a.data(), q.data(), q.data(), v.data(), p.data(), 1.0, INFINITY), InvalidArgument);
  const float* none = nullptr;
  float* out = nullptr;
  EXPECT_FALSE(eigenbasis(0, none, out, out, 1.0).used_float64);
  EXPECT_FALSE(qr_refresh(0, none, none, out, out, out, 1.0, 0.0).skipped);
}

}  // namespace
}  // namespace asteria::linalg
