// A cyclic Jacobi eigensolver in double, for the linalg tests: a reference that shares no code with
// LAPACK. Each test keeps its own matrix layout and passes its accessor `at(m, n, i, j)` (a reference
// to entry (i, j) of the n x n matrix m).
#pragma once

#include <cmath>
#include <cstddef>
#include <vector>

namespace asteria::linalg::reference {

// Rotates away each off-diagonal entry of the symmetric `a` in turn until it is diagonal to working
// precision. Returns the eigenvalues (unordered) in w and the eigenvectors as the columns of v.
template <typename At>
void jacobi_eigen(int n, std::vector<double> a, std::vector<double>& w, std::vector<double>& v, At at) {
  v.assign(static_cast<std::size_t>(n) * n, 0.0);
  for (int i = 0; i < n; ++i) at(v, n, i, i) = 1.0;
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0, total = 0;
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        const double x = at(a, n, i, j);
        total += x * x;
        if (i != j) off += x * x;
      }
    }
    if (off <= 1e-30 * total) break;
    for (int p = 0; p < n; ++p) {
      for (int q = p + 1; q < n; ++q) {
        const double apq = at(a, n, p, q);
        if (apq == 0.0) continue;
        const double theta = (at(a, n, q, q) - at(a, n, p, p)) / (2 * apq);
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::abs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (int k = 0; k < n; ++k) {  // A <- A J
          const double akp = at(a, n, k, p), akq = at(a, n, k, q);
          at(a, n, k, p) = c * akp - s * akq;
          at(a, n, k, q) = s * akp + c * akq;
        }
        for (int k = 0; k < n; ++k) {  // A <- J^T A
          const double apk = at(a, n, p, k), aqk = at(a, n, q, k);
          at(a, n, p, k) = c * apk - s * aqk;
          at(a, n, q, k) = s * apk + c * aqk;
        }
        for (int k = 0; k < n; ++k) {  // V <- V J
          const double vkp = at(v, n, k, p), vkq = at(v, n, k, q);
          at(v, n, k, p) = c * vkp - s * vkq;
          at(v, n, k, q) = s * vkp + c * vkq;
        }
      }
    }
  }
  w.resize(n);
  for (int i = 0; i < n; ++i) w[i] = at(a, n, i, i);
}

}  // namespace asteria::linalg::reference
