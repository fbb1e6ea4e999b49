// The shim's eigendecompositions read nothing past the caller's matrix. Each test puts the matrix's
// last element just before a page the process may not touch (mmap, then PROT_NONE), so a read past
// it faults. ctest also runs this suite with OPENBLAS_CORETYPE=Prescott (CMakeLists.txt): OpenBLAS
// picks that kernel set on CPUs it does not recognize, and its SSE ssymv reads up to 16 bytes past
// A's last element, which took LAPACK's xSYTD2 past the end of a worker's matrix under ThreadSanitizer.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <random>
#include <stdexcept>
#include <vector>

#include "asteria/linalg/lapack.h"

namespace asteria::linalg {
namespace {

// `count` elements of T ending exactly where an inaccessible page begins.
template <typename T>
class GuardedBuffer {
 public:
  explicit GuardedBuffer(std::size_t count) {
    const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    const std::size_t data_pages = (count * sizeof(T) + page - 1) / page;
    size_ = (data_pages + 1) * page;
    void* base = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) throw std::runtime_error("mmap failed");
    base_ = static_cast<char*>(base);
    if (mprotect(base_ + data_pages * page, page, PROT_NONE) != 0) throw std::runtime_error("mprotect failed");
    data_ = reinterpret_cast<T*>(base_ + data_pages * page) - count;
  }
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;
  ~GuardedBuffer() { munmap(base_, size_); }
  T* data() { return data_; }

 private:
  char* base_ = nullptr;
  std::size_t size_ = 0;
  T* data_ = nullptr;
};

// A symmetric matrix with a known spread of eigenvalues: diag(1..n) plus a small random symmetric part.
template <typename T>
std::vector<T> test_matrix(int n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> noise(-0.1, 0.1);
  std::vector<T> a(static_cast<std::size_t>(n) * n);
  for (int j = 0; j < n; ++j) {
    for (int i = j; i < n; ++i) {
      const T x = static_cast<T>((i == j ? j + 1 : 0) + noise(rng));
      a[i + static_cast<std::size_t>(j) * n] = a[j + static_cast<std::size_t>(i) * n] = x;
    }
  }
  return a;
}

// max_j ||A q_j - w_j q_j||, relative to the largest eigenvalue.
template <typename T>
double residual(int n, const std::vector<T>& a, const T* q, const T* w) {
  double worst = 0;
  for (int j = 0; j < n; ++j) {
    double sum = 0;
    for (int i = 0; i < n; ++i) {
      double aq = 0;
      for (int k = 0; k < n; ++k) aq += double(a[i + static_cast<std::size_t>(k) * n]) * q[k + j * n];
      const double r = aq - double(w[j]) * q[i + j * n];
      sum += r * r;
    }
    worst = std::max(worst, std::sqrt(sum));
  }
  return worst / std::abs(double(w[n - 1]));
}

template <typename T>
void decompose_at_guard(int n, bool in_house, double tolerance) {
  const std::vector<T> a = test_matrix<T>(n, 7 + n);
  GuardedBuffer<T> matrix(a.size()), values(static_cast<std::size_t>(n));
  std::copy(a.begin(), a.end(), matrix.data());
  std::vector<T> work;
  std::vector<int> iwork;
  if (in_house) {
    eigh(n, matrix.data(), n, values.data(), work, iwork);
  } else {
    syevd(n, matrix.data(), n, values.data(), work, iwork);
  }
  EXPECT_LT(residual(n, a, matrix.data(), values.data()), tolerance) << (in_house ? "eigh" : "syevd") << " n=" << n;
}

class AtAGuardPage : public ::testing::TestWithParam<int> {};

TEST_P(AtAGuardPage, EighFloat) { decompose_at_guard<float>(GetParam(), true, 1e-5); }
TEST_P(AtAGuardPage, EighDouble) { decompose_at_guard<double>(GetParam(), true, 1e-12); }
TEST_P(AtAGuardPage, SyevdFloat) { decompose_at_guard<float>(GetParam(), false, 1e-5); }
TEST_P(AtAGuardPage, SyevdDouble) { decompose_at_guard<double>(GetParam(), false, 1e-12); }

// Before the copies in lapack.cpp, every float size from 5 up faulted under the Prescott kernels.
INSTANTIATE_TEST_SUITE_P(Sizes, AtAGuardPage, ::testing::Values(1, 2, 5, 17, 32, 33, 64, 100));

}  // namespace
}  // namespace asteria::linalg
