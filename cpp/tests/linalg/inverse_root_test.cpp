// Inverse roots checked against a reference that shares no code with LAPACK: a cyclic Jacobi
// eigensolver in double, written here, and the identity root^p A = I for root = A^(-1/p),
// computed with plain loops. Tolerances are float32's (about 1e-6 relative per operation) times
// the conditioning.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "asteria/common/errors.h"
#include "asteria/linalg/inverse_root.h"
#include "asteria/linalg/lapack.h"
#include "jacobi_reference.h"

namespace asteria::linalg {
namespace {

using Matrix = std::vector<double>;  // n x n, column-major

double& at(Matrix& m, int n, int i, int j) { return m[i + static_cast<std::size_t>(j) * n]; }
double at(const Matrix& m, int n, int i, int j) { return m[i + static_cast<std::size_t>(j) * n]; }

Matrix identity(int n) {
  Matrix m(static_cast<std::size_t>(n) * n, 0.0);
  for (int i = 0; i < n; ++i) at(m, n, i, i) = 1.0;
  return m;
}

Matrix multiply(const Matrix& a, const Matrix& b, int n) {
  Matrix c(a.size(), 0.0);
  for (int j = 0; j < n; ++j) {
    for (int k = 0; k < n; ++k) {
      const double bkj = at(b, n, k, j);
      for (int i = 0; i < n; ++i) at(c, n, i, j) += at(a, n, i, k) * bkj;
    }
  }
  return c;
}

double frobenius(const Matrix& m) {
  double sum = 0;
  for (double x : m) sum += x * x;
  return std::sqrt(sum);
}

double relative_error(const Matrix& actual, const Matrix& expected) {
  Matrix diff(actual.size());
  for (std::size_t i = 0; i < diff.size(); ++i) diff[i] = actual[i] - expected[i];
  return frobenius(diff) / frobenius(expected);
}

// The shared Jacobi reference (jacobi_reference.h) on this file's layout.
void jacobi_eigen(int n, const Matrix& a, std::vector<double>& w, Matrix& v) {
  reference::jacobi_eigen(n, a, w, v,
                          [](Matrix& m, int size, int i, int j) -> double& { return at(m, size, i, j); });
}

// The contract of inverse_root.h, evaluated from Jacobi's eigenpairs.
Matrix reference_root(int n, const Matrix& a, const RootSpec& spec) {
  std::vector<double> w;
  Matrix v;
  jacobi_eigen(n, a, w, v);
  const double lambda_min = spec.scale * *std::min_element(w.begin(), w.end());
  const double lambda_max = spec.scale * *std::max_element(w.begin(), w.end());
  const double offset = std::max(0.0, -lambda_min);
  const double ridge = spec.eps + spec.relative_eps * (lambda_max + offset);
  Matrix root(a.size(), 0.0);
  for (int k = 0; k < n; ++k) {
    const double d = std::pow((spec.scale * w[k] + offset) + ridge, spec.exponent);
    for (int j = 0; j < n; ++j) {
      for (int i = 0; i < n; ++i) at(root, n, i, j) += at(v, n, i, k) * d * at(v, n, j, k);
    }
  }
  return root;
}

std::vector<float> to_float(const Matrix& m) { return std::vector<float>(m.begin(), m.end()); }
Matrix to_double(const std::vector<float>& m) { return Matrix(m.begin(), m.end()); }

// G G^T / cols (+ shift I) with G n x cols Gaussian: SPD for cols >= n, rank cols otherwise.
Matrix gram(int n, int cols, double shift, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal;
  Matrix g(static_cast<std::size_t>(n) * cols);
  for (double& x : g) x = normal(rng);
  Matrix a(static_cast<std::size_t>(n) * n, 0.0);
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < n; ++i) {
      double sum = 0;
      for (int k = 0; k < cols; ++k) sum += at(g, n, i, k) * at(g, n, j, k);
      at(a, n, i, j) = sum / cols + (i == j ? shift : 0.0);
    }
  }
  return a;
}

// Q diag(eigenvalues) Q^T with Q from Gram-Schmidt on a Gaussian matrix.
Matrix with_spectrum(const std::vector<double>& eigenvalues, unsigned seed) {
  const int n = static_cast<int>(eigenvalues.size());
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal;
  Matrix q(static_cast<std::size_t>(n) * n);
  for (double& x : q) x = normal(rng);
  for (int j = 0; j < n; ++j) {
    for (int pass = 0; pass < 2; ++pass) {  // twice is enough for orthogonality to round-off
      for (int k = 0; k < j; ++k) {
        double dot = 0;
        for (int i = 0; i < n; ++i) dot += at(q, n, i, j) * at(q, n, i, k);
        for (int i = 0; i < n; ++i) at(q, n, i, j) -= dot * at(q, n, i, k);
      }
    }
    double norm = 0;
    for (int i = 0; i < n; ++i) norm += at(q, n, i, j) * at(q, n, i, j);
    for (int i = 0; i < n; ++i) at(q, n, i, j) /= std::sqrt(norm);
  }
  Matrix a(q.size(), 0.0);
  for (int k = 0; k < n; ++k) {
    for (int j = 0; j < n; ++j) {
      for (int i = 0; i < n; ++i) at(a, n, i, j) += at(q, n, i, k) * eigenvalues[k] * at(q, n, j, k);
    }
  }
  return a;
}

std::vector<double> logspace(double from, double to, int count) {
  std::vector<double> values(count);
  for (int i = 0; i < count; ++i) values[i] = from * std::pow(to / from, count == 1 ? 0.0 : double(i) / (count - 1));
  return values;
}

Matrix float_root(int n, const Matrix& a, const RootSpec& spec, RootReport* report = nullptr) {
  const std::vector<float> input = to_float(a);
  std::vector<float> out(input.size());
  const RootReport r = inverse_root(n, input.data(), n, out.data(), n, spec);
  if (report != nullptr) *report = r;
  return to_double(out);
}

// root^(-1/exponent) A - I, relative: checks a root without any eigensolver.
double identity_residual(int n, const Matrix& root, const Matrix& a, int power) {
  Matrix product = a;
  for (int i = 0; i < power; ++i) product = multiply(root, product, n);
  return relative_error(product, identity(n));
}

class RandomSpd : public ::testing::TestWithParam<int> {};

TEST_P(RandomSpd, MatchesJacobiAndInvertsTheMatrix) {
  const int n = GetParam();
  const Matrix a = gram(n, 2 * n, 0.5, 17 + n);  // spectrum within about [0.6, 3.5]
  const RootSpec spec{.exponent = -0.25, .eps = 1e-12, .scale = 1.0};
  RootReport report;
  const Matrix root = float_root(n, a, spec, &report);

  EXPECT_FALSE(report.used_float64);
  EXPECT_GT(report.lambda_min, 0.0);
  EXPECT_LE(report.lambda_min, report.lambda_max);
  EXPECT_LT(identity_residual(n, root, a, 4), 2e-5);
  if (n <= 64) {
    EXPECT_LT(relative_error(root, reference_root(n, a, spec)), 5e-6);
  }
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < j; ++i) ASSERT_EQ(at(root, n, i, j), at(root, n, j, i)) << "not symmetric at " << i << "," << j;
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, RandomSpd, ::testing::Values(1, 2, 7, 64, 200));

struct ExponentCase {
  double exponent;
  int power;  // root^power A = I
};

class Exponents : public ::testing::TestWithParam<ExponentCase> {};

TEST_P(Exponents, MatchJacobiWithScale) {
  const int n = 24;
  const Matrix a = gram(n, 3 * n, 0.1, 5);
  const double scale = 1 / (1 - std::pow(0.999, 10));  // a bias correction, about 100
  const RootSpec spec{.exponent = GetParam().exponent, .eps = 1e-8, .scale = scale};
  const Matrix root = float_root(n, a, spec);
  EXPECT_LT(relative_error(root, reference_root(n, a, spec)), 1e-5);

  Matrix scaled = a;
  for (double& x : scaled) x *= scale;
  EXPECT_LT(identity_residual(n, root, scaled, GetParam().power), 1e-4);
}

INSTANTIATE_TEST_SUITE_P(PthRoots, Exponents,
                         ::testing::Values(ExponentCase{-0.5, 2}, ExponentCase{-0.25, 4}, ExponentCase{-0.125, 8}));

TEST(InverseRoot, IllConditionedSpectrumNeedsEpsAboveFloatNoise) {
  const int n = 48;
  const Matrix a = with_spectrum(logspace(1e-8, 1e2, n), 3);
  // float32 resolves eigenvalues to about 2e-7 * 1e2 = 2e-5 (LAPACK's ssyevd as well); with eps
  // above that the root is a smooth function of the computed spectrum, its error about
  // |p| * 2e-5 / eps. The reference starts from the same float32-rounded matrix, so what is
  // measured is the solver's error.
  const RootSpec spec{.exponent = -0.25, .eps = 1e-2, .scale = 1.0};
  RootReport report;
  const Matrix root = float_root(n, a, spec, &report);
  EXPECT_LT(relative_error(root, reference_root(n, to_double(to_float(a)), spec)), 1e-3);
  EXPECT_NEAR(report.lambda_max, 1e2, 1e-3);
  EXPECT_NEAR(report.lambda_min, 0.0, 1e-4);
}

TEST(InverseRoot, Float64ResolvesTheWholeIllConditionedSpectrum) {
  const int n = 48;
  const Matrix a = with_spectrum(logspace(1e-8, 1e2, n), 3);
  const RootSpec spec{.exponent = -0.25, .eps = 1e-12, .scale = 1.0};
  Matrix root(a.size());
  const RootReport report = inverse_root(n, a.data(), n, root.data(), n, spec);
  EXPECT_TRUE(report.used_float64);
  EXPECT_NEAR(report.lambda_min, 1e-8, 1e-12);
  EXPECT_LT(relative_error(root, reference_root(n, a, spec)), 1e-6);
}

TEST(InverseRoot, RankDeficientNullSpaceGetsEpsToTheExponent) {
  const int n = 40, rank = 10;
  const Matrix a = gram(n, rank, 0.0, 11);
  const double eps = 1e-3;
  const RootSpec spec{.exponent = -0.5, .eps = eps, .scale = 1.0};
  const Matrix root = float_root(n, a, spec);
  const Matrix expected = reference_root(n, to_double(to_float(a)), spec);
  EXPECT_LT(relative_error(root, expected), 1e-3);

  // A vector orthogonal to the range of A is an eigenvector of the root with eigenvalue
  // eps^(-1/2), up to the float32 noise of the zero eigenvalues next to eps.
  std::vector<double> w;
  Matrix v;
  jacobi_eigen(n, a, w, v);
  const int null = static_cast<int>(std::min_element(w.begin(), w.end()) - w.begin());
  double quadratic_form = 0;
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < n; ++i) quadratic_form += at(v, n, i, null) * at(root, n, i, j) * at(v, n, j, null);
  }
  EXPECT_NEAR(quadratic_form, 1 / std::sqrt(eps), 0.01 / std::sqrt(eps));
}

TEST(InverseRoot, NegativeSpectrumIsShiftedSoItsMinimumBecomesEps) {
  const std::vector<double> eigenvalues = {-0.5, 0.1, 1.0, 3.0, 4.0};
  const int n = static_cast<int>(eigenvalues.size());
  const Matrix a = with_spectrum(eigenvalues, 7);
  const RootSpec spec{.exponent = -0.5, .eps = 0.01, .scale = 2.0};
  RootReport report;
  const Matrix root = float_root(n, a, spec, &report);
  EXPECT_NEAR(report.lambda_min, -1.0, 1e-5);  // of scale * A
  EXPECT_NEAR(report.lambda_max, 8.0, 1e-5);
  EXPECT_LT(relative_error(root, reference_root(n, a, spec)), 1e-5);

  // The eigenvector of -0.5 now has 2 * -0.5 + eps + 1 = eps, so root's largest eigenvalue is
  // eps^(-1/2) = 10.
  std::vector<double> w;
  Matrix v;
  jacobi_eigen(n, root, w, v);
  EXPECT_NEAR(*std::max_element(w.begin(), w.end()), 10.0, 1e-3);
}

TEST(InverseRoot, RelativeEpsBoundsTheConditionNumberWhateverTheScale) {
  const int n = 40, rank = 10;
  const Matrix a = gram(n, rank, 0.0, 13);  // rank-deficient: 30 zero eigenvalues
  const double relative_eps = 1e-4;
  for (const double scale : {1e-6, 1.0, 1e4}) {
    const RootSpec spec{.exponent = -0.25, .eps = 1e-12, .scale = scale, .relative_eps = relative_eps};
    RootReport report;
    const Matrix root = float_root(n, a, spec, &report);
    // float32's eigenvalue noise (about 2e-7 of the largest) next to a ridge of 1e-4 of it: the same
    // relative error, about 3e-4, at every scale.
    EXPECT_LT(relative_error(root, reference_root(n, to_double(to_float(a)), spec)), 1e-3) << "scale " << scale;

    // The root's eigenvalues lie in [(mu_max (1 + r))^p, (r mu_max)^p], so its condition number is at
    // most (1 + 1/r)^(-p) = about 10 here, whatever the scale; eps alone would leave about 1e3.
    std::vector<double> w;
    Matrix v;
    jacobi_eigen(n, root, w, v);
    const double largest = *std::max_element(w.begin(), w.end()), smallest = *std::min_element(w.begin(), w.end());
    EXPECT_NEAR(largest, std::pow(relative_eps * report.lambda_max + 1e-12, -0.25), 1e-3 * largest);
    EXPECT_LE(largest / smallest, std::pow(1 + 1 / relative_eps, 0.25) * (1 + 1e-4));
  }
}

TEST(InverseRoot, RespectsLeadingDimensions) {
  const int n = 9, lda = 12, ldo = 11;
  const Matrix a = gram(n, 2 * n, 0.5, 23);
  const RootSpec spec{.exponent = -0.25};
  std::vector<float> padded(static_cast<std::size_t>(lda) * n, std::numeric_limits<float>::quiet_NaN());
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < n; ++i) padded[i + j * lda] = static_cast<float>(at(a, n, i, j));
  }
  std::vector<float> out(static_cast<std::size_t>(ldo) * n, -7.0f);
  inverse_root(n, padded.data(), lda, out.data(), ldo, spec);

  const Matrix expected = float_root(n, a, spec);
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < ldo; ++i) {
      if (i < n) {
        EXPECT_EQ(out[i + j * ldo], static_cast<float>(at(expected, n, i, j)));
      } else {
        EXPECT_EQ(out[i + j * ldo], -7.0f) << "wrote into the padding";
      }
    }
  }
}

TEST(InverseRoot, EmptyMatrixIsANoOp) {
  const RootReport report = inverse_root(0, static_cast<const float*>(nullptr), 1, nullptr, 1, RootSpec{});
  EXPECT_FALSE(report.used_float64);
}

void expect_numerical_error(const std::function<void()>& call, const std::vector<std::string>& fragments) {
  try {
    call();
    ADD_FAILURE() << "no NumericalError";
  } catch (const NumericalError& error) {
    for (const std::string& fragment : fragments) {
      EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos)
          << "'" << fragment << "' not in: " << error.what();
    }
  }
}

TEST(InverseRoot, RejectsNonFiniteInputNamingTheEntry) {
  const int n = 6;
  const std::vector<float> good = to_float(gram(n, 2 * n, 0.5, 1));
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> a = good;
    a[3 + 5 * n] = bad;
    a[4 + 5 * n] = bad;
    std::vector<float> out(a.size(), 42.0f);
    expect_numerical_error([&] { inverse_root(n, a.data(), n, out.data(), n, RootSpec{}); },
                           {"non-finite input", "a(3, 5)"});
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == 42.0f; }));
  }
  Matrix a64 = gram(n, 2 * n, 0.5, 1);
  a64[2] = std::numeric_limits<double>::quiet_NaN();
  Matrix out64(a64.size());
  expect_numerical_error([&] { inverse_root(n, a64.data(), n, out64.data(), n, RootSpec{}); },
                         {"non-finite input", "a(2, 0)=nan"});
}

TEST(InverseRoot, Float64RetryRescuesAFloat32Overflow) {
  // c (I + ones ones^T) with c = 4e37: entries fit float32, the largest eigenvalue 9c does not;
  // the other seven are c.
  const int n = 8;
  const double c = 4e37;
  Matrix a(static_cast<std::size_t>(n) * n, c);
  for (int i = 0; i < n; ++i) at(a, n, i, i) = 2 * c;
  const RootSpec spec{.exponent = -0.25, .eps = 1e-4, .scale = 1.0};
  RootReport report;
  const Matrix root = float_root(n, a, spec, &report);
  EXPECT_TRUE(report.used_float64);
  EXPECT_NEAR(report.lambda_max / (9 * c), 1.0, 1e-6);
  EXPECT_NEAR(report.lambda_min / c, 1.0, 1e-6);
  EXPECT_LT(relative_error(root, reference_root(n, a, spec)), 1e-6);
}

TEST(InverseRoot, QualityGateLeavesOutputUntouched) {
  // A zero eigenvalue with eps = 1e-30 and exponent -4 gives 1e120: finite in float64, not in
  // float32, so both attempts fail and the caller keeps its previous root.
  const int n = 3;
  Matrix a(9, 0.0);  // diag(0, 1, 2): the zero eigenvalue is exact in both precisions
  at(a, n, 1, 1) = 1.0;
  at(a, n, 2, 2) = 2.0;
  const RootSpec spec{.exponent = -4, .eps = 1e-30, .scale = 1.0};
  const std::vector<float> input = to_float(a);
  std::vector<float> out(input.size(), 42.0f);
  expect_numerical_error([&] { inverse_root(n, input.data(), n, out.data(), n, spec); },
                         {"float32 attempt failed", "float64 retry failed", "overflows float32"});
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == 42.0f; }));

  // In float64, (1e-300)^-2 = 1e600 is infinite.
  const RootSpec overflow64{.exponent = -2, .eps = 1e-300, .scale = 1.0};
  Matrix out64(a.size(), 42.0);
  expect_numerical_error([&] { inverse_root(n, a.data(), n, out64.data(), n, overflow64); },
                         {"non-finite result", "n=3"});
  EXPECT_TRUE(std::all_of(out64.begin(), out64.end(), [](double x) { return x == 42.0; }));
}

void expect_invalid(const RootSpec& spec, const std::string& message) {
  try {
    validate(spec);
    ADD_FAILURE() << "no InvalidArgument for " << message;
  } catch (const InvalidArgument& error) {
    EXPECT_EQ(std::string(error.what()), message);
  }
  std::vector<float> a = {1.0f}, out = {42.0f};
  EXPECT_THROW(inverse_root(1, a.data(), 1, out.data(), 1, spec), InvalidArgument);
  EXPECT_EQ(out[0], 42.0f);
}

TEST(RootSpecValidation, NamesTheFieldAndValue) {
  EXPECT_NO_THROW(validate(RootSpec{}));
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  expect_invalid({.exponent = 0.5}, "Invalid exponent=0.5: must be a finite number < 0");
  expect_invalid({.exponent = 0.0}, "Invalid exponent=0: must be a finite number < 0");
  expect_invalid({.exponent = nan}, "Invalid exponent=nan: must be a finite number < 0");
  expect_invalid({.exponent = -inf}, "Invalid exponent=-inf: must be a finite number < 0");
  expect_invalid({.eps = 0.0}, "Invalid eps=0: must be a finite number > 0");
  expect_invalid({.eps = -1e-12}, "Invalid eps=-1e-12: must be a finite number > 0");
  expect_invalid({.eps = inf}, "Invalid eps=inf: must be a finite number > 0");
  expect_invalid({.scale = -1.0}, "Invalid scale=-1: must be a finite number > 0");
  expect_invalid({.scale = nan}, "Invalid scale=nan: must be a finite number > 0");
  expect_invalid({.relative_eps = -1e-3}, "Invalid relative_eps=-0.001: must be a finite number >= 0");
  expect_invalid({.relative_eps = nan}, "Invalid relative_eps=nan: must be a finite number >= 0");
  EXPECT_NO_THROW(validate(RootSpec{.relative_eps = 0.0}));
}

TEST(InverseRoot, RejectsBadShapes) {
  std::vector<float> a(16, 1.0f), out(16);
  const RootSpec spec;
  EXPECT_THROW(inverse_root(-1, a.data(), 1, out.data(), 1, spec), InvalidArgument);
  try {
    inverse_root(4, a.data(), 3, out.data(), 4, spec);
    ADD_FAILURE() << "no InvalidArgument";
  } catch (const InvalidArgument& error) {
    EXPECT_EQ(std::string(error.what()), "[inverse_root] Invalid lda=3: must be >= max(1, n=4)");
  }
  EXPECT_THROW(inverse_root(4, a.data(), 4, out.data(), 2, spec), InvalidArgument);
  EXPECT_THROW(inverse_root(4, static_cast<const float*>(nullptr), 4, out.data(), 4, spec), InvalidArgument);
}

TEST(InverseRoot, ThreadsWithTheirOwnWorkspacesMatchSerialResults) {
  // Different sizes per thread, so that a workspace shared by mistake would be resized under
  // another thread's feet.
  constexpr int kThreads = 4, kRounds = 3;
  const RootSpec spec{.exponent = -0.25, .eps = 1e-6, .scale = 1.0};
  std::vector<std::vector<float>> inputs, serial;
  std::vector<int> sizes;
  for (int t = 0; t < kThreads; ++t) {
    const int n = 30 + 37 * t;
    sizes.push_back(n);
    inputs.push_back(to_float(gram(n, 2 * n, 0.5, 100 + t)));
    serial.emplace_back(inputs.back().size());
    inverse_root(n, inputs.back().data(), n, serial.back().data(), n, spec);
  }
  std::vector<std::vector<float>> concurrent(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const int n = sizes[t];
      concurrent[t].assign(inputs[t].size(), 0.0f);
      for (int round = 0; round < kRounds; ++round) {
        inverse_root(n, inputs[t].data(), n, concurrent[t].data(), n, spec);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  // Bitwise: the refresh runtime's determinism rests on a root not depending on which worker
  // computed it, or on what its workspace held before.
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(concurrent[t], serial[t]) << "thread " << t;
}

// eigh is the in-house path of the shim (tridiagonalization, packed back-transformation): its
// panel (32), reflector block (64) and column slice (256) boundaries each get a size on either side.
class Eigh : public ::testing::TestWithParam<int> {};

template <typename T>
void expect_eigenpairs(int n, double tolerance) {
  const Matrix a = gram(n, n + 3, 0.0, 31 + n);
  std::vector<T> q(a.begin(), a.end()), w(n), reference(a.begin(), a.end()), reference_w(n);
  std::vector<T> work;
  std::vector<int> iwork;
  eigh(n, q.data(), n, w.data(), work, iwork);
  syevd(n, reference.data(), n, reference_w.data(), work, iwork);

  const Matrix qd(q.begin(), q.end());
  Matrix residual = multiply(a, qd, n), gram_q(a.size(), 0.0);
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < n; ++i) at(residual, n, i, j) -= at(qd, n, i, j) * w[j];
  }
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < n; ++i) {
      for (int k = 0; k < n; ++k) at(gram_q, n, i, j) += at(qd, n, k, i) * at(qd, n, k, j);
    }
  }
  EXPECT_LT(frobenius(residual) / frobenius(a), tolerance);
  EXPECT_LT(relative_error(gram_q, identity(n)), tolerance);
  EXPECT_TRUE(std::is_sorted(w.begin(), w.end()));
  for (int i = 0; i < n; ++i) EXPECT_NEAR(w[i], reference_w[i], tolerance * w[n - 1]);
}

TEST_P(Eigh, FloatEigenpairs) { expect_eigenpairs<float>(GetParam(), 2e-6); }
TEST_P(Eigh, DoubleEigenpairs) { expect_eigenpairs<double>(GetParam(), 1e-14); }

INSTANTIATE_TEST_SUITE_P(Sizes, Eigh, ::testing::Values(1, 2, 3, 31, 32, 33, 65, 66, 257));

TEST(LapackShim, ErrorsNameTheFunction) {
  std::vector<float> a(9), w(3), work;
  std::vector<int> iwork;
  try {
    syevd(3, a.data(), 2, w.data(), work, iwork);
    ADD_FAILURE() << "no InvalidArgument";
  } catch (const InvalidArgument& error) {
    EXPECT_EQ(std::string(error.what()), "[syevd] Invalid lda=2: must be >= max(1, 3)");
  }
  EXPECT_THROW(eigh(-1, a.data(), 1, w.data(), work, iwork), InvalidArgument);
  EXPECT_THROW(gemm(false, true, 3, 3, 3, 1.0f, a.data(), 2, a.data(), 3, 0.0f, w.data(), 3), InvalidArgument);
}

}  // namespace
}  // namespace asteria::linalg
