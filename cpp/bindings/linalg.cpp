// Bindings of the numerics, for tests, benchmarks and a C++-free reference path.
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "asteria/common/errors.h"
#include "asteria/linalg/eigenbasis.h"
#include "asteria/linalg/inverse_root.h"
#include "asteria/linalg/lapack.h"
#include "bindings.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace asteria::bindings {

namespace {

template <typename T>
using Matrix = nb::ndarray<T, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

int square_dim(std::size_t rows, std::size_t cols, const char* name) {
  if (rows != cols) {
    throw InvalidArgument(std::string("Invalid ") + name + " shape (" + std::to_string(rows) + ", " +
                          std::to_string(cols) + "): must be square");
  }
  return static_cast<int>(rows);
}

// The routines read the lower triangle of `a` only. A matrix that is not symmetric (beyond the rounding
// of a product like X X^T: 1e-4 of its largest entry) is refused rather than silently half read.
// Non-finite entries are left to the routines, which raise NumericalError on them.
template <typename T>
void require_symmetric(const T* a, int n, const char* name) {
  const std::size_t nn = static_cast<std::size_t>(n);
  double largest = 0.0;
  for (std::size_t k = 0; k < nn * nn; ++k) largest = std::max(largest, std::abs(static_cast<double>(a[k])));
  const double tolerance = 1e-4 * largest;
  for (std::size_t i = 0; i < nn; ++i) {
    for (std::size_t j = 0; j < i; ++j) {
      const double here = a[i * nn + j], mirrored = a[j * nn + i];
      if (std::abs(here - mirrored) > tolerance) {
        throw InvalidArgument(std::string("Invalid ") + name + ": not symmetric, " + name + "[" + std::to_string(i) +
                              ", " + std::to_string(j) + "]=" + format_number(here) + " but " + name + "[" +
                              std::to_string(j) + ", " + std::to_string(i) + "]=" + format_number(mirrored) +
                              " (allowed: a difference of at most 1e-4 of the largest |entry|, " +
                              format_number(largest) + ")");
      }
    }
  }
}

// A NumPy array that owns `data` (allocated with new[]): a matrix (rows x cols) or a vector (rows).
template <typename T>
nb::ndarray<nb::numpy, T> owned_array(T* data, std::size_t rows, std::optional<std::size_t> cols = std::nullopt) {
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  if (!cols) return nb::ndarray<nb::numpy, T>(data, {rows}, owner);
  return nb::ndarray<nb::numpy, T>(data, {rows, *cols}, owner);
}

template <typename T>
nb::tuple inverse_root_py(Matrix<T> a, double exponent, double eps, double scale, double relative_eps) {
  const int n = square_dim(a.shape(0), a.shape(1), "a");
  const std::size_t nn = static_cast<std::size_t>(n);
  T* out = new T[nn * nn];
  auto result = owned_array(out, nn, nn);
  linalg::RootReport report;
  {
    nb::gil_scoped_release release;
    require_symmetric(a.data(), n, "a");
    const int ld = std::max(1, n);  // LAPACK's rule, also for n = 0
    report = linalg::inverse_root(n, a.data(), ld, out, ld, linalg::RootSpec{exponent, eps, scale, relative_eps});
  }
  nb::dict info;
  info["used_float64"] = report.used_float64;
  info["lambda_min"] = report.lambda_min;
  info["lambda_max"] = report.lambda_max;
  return nb::make_tuple(result, info);
}

nb::dict basis_info(const linalg::BasisReport& report) {
  nb::dict info;
  info["used_float64"] = report.used_float64;
  info["skipped"] = report.skipped;
  info["off_diagonal_ratio"] = report.off_diagonal_ratio;
  return info;
}

template <typename T>
nb::tuple eigenbasis_py(Matrix<T> a, double scale) {
  const int n = square_dim(a.shape(0), a.shape(1), "a");
  const std::size_t nn = static_cast<std::size_t>(n);
  T* q = new T[nn * nn];
  auto q_array = owned_array(q, nn, nn);
  T* values = new T[nn];
  auto values_array = owned_array(values, nn);
  linalg::BasisReport report;
  {
    nb::gil_scoped_release release;
    require_symmetric(a.data(), n, "a");
    report = linalg::eigenbasis(n, a.data(), q, values, scale);
  }
  return nb::make_tuple(q_array, values_array, basis_info(report));
}

template <typename T>
nb::tuple qr_refresh_py(Matrix<T> a, Matrix<T> q_prev, double scale, double skip_tol) {
  const int n = square_dim(a.shape(0), a.shape(1), "a");
  if (q_prev.shape(0) != a.shape(0) || q_prev.shape(1) != a.shape(1)) {
    throw InvalidArgument("Invalid q_prev shape (" + std::to_string(q_prev.shape(0)) + ", " +
                          std::to_string(q_prev.shape(1)) + "): must match a's (" + std::to_string(n) + ", " +
                          std::to_string(n) + ")");
  }
  const std::size_t nn = static_cast<std::size_t>(n);
  T* q = new T[nn * nn];
  auto q_array = owned_array(q, nn, nn);
  T* estimates = new T[nn];
  auto estimates_array = owned_array(estimates, nn);
  std::vector<T> perm(nn);
  linalg::BasisReport report;
  {
    nb::gil_scoped_release release;
    require_symmetric(a.data(), n, "a");
    report = linalg::qr_refresh(n, a.data(), q_prev.data(), q, estimates, perm.data(), scale, skip_tol);
  }
  auto* perm_out = new std::int64_t[nn];
  for (std::size_t j = 0; j < nn; ++j) perm_out[j] = static_cast<std::int64_t>(perm[j]);
  return nb::make_tuple(q_array, estimates_array, owned_array(perm_out, nn), basis_info(report));
}

}  // namespace

// The matrices are taken as they are (.noconvert()): C-contiguous float32 or float64 arrays, all of one
// dtype, computed in that dtype. With conversion allowed, a call whose scalar needed a conversion (a NumPy
// float64) fell through to the float32 overload and copied float64 matrices to float32 silently.
void init_linalg(nb::module_& m) {
  constexpr const char* doc =
      "inverse_root(a, exponent, eps, scale=1.0, relative_eps=0.0) -> (root, info): (scale*A)^exponent of a "
      "symmetric matrix with eps + relative_eps * (the largest eigenvalue) added to the eigenvalues (shifted up "
      "first when the smallest is negative); float32 with a float64 "
      "retry; raises NumericalError on non-finite input or output and ValueError on an `a` that is not "
      "symmetric (beyond 1e-4 of its largest entry). Releases the GIL.";
  m.def("inverse_root", &inverse_root_py<float>, "a"_a.noconvert(), "exponent"_a, "eps"_a, "scale"_a = 1.0,
        "relative_eps"_a = 0.0, doc);
  m.def("inverse_root", &inverse_root_py<double>, "a"_a.noconvert(), "exponent"_a, "eps"_a, "scale"_a = 1.0,
        "relative_eps"_a = 0.0, doc);

  constexpr const char* eigenbasis_doc =
      "eigenbasis(a, scale=1.0) -> (q, values, info): eigenvectors of scale*A as the columns of q, sorted by "
      "descending eigenvalue; float32 with a float64 retry; raises NumericalError on non-finite input or output "
      "and ValueError on an `a` that is not symmetric. Releases the GIL.";
  m.def("eigenbasis", &eigenbasis_py<float>, "a"_a.noconvert(), "scale"_a = 1.0, eigenbasis_doc);
  m.def("eigenbasis", &eigenbasis_py<double>, "a"_a.noconvert(), "scale"_a = 1.0, eigenbasis_doc);
  constexpr const char* qr_refresh_doc =
      "qr_refresh(a, q_prev, scale=1.0, skip_tol=0.0) -> (q, estimates, perm, info): SOAP's warm-started "
      "refresh: T = scale*A @ q_prev, est = diag(q_prev.T @ T), perm = stable descending argsort(est), q = "
      "torch.linalg.qr(T[:, perm]).Q (LAPACK signs); with skip_tol > 0 a basis whose off-diagonal ratio is <= "
      "skip_tol is kept (q = q_prev, identity perm, unsorted estimates); ValueError on an `a` that is not "
      "symmetric. Releases the GIL.";
  m.def("qr_refresh", &qr_refresh_py<float>, "a"_a.noconvert(), "q_prev"_a.noconvert(), "scale"_a = 1.0,
        "skip_tol"_a = 0.0, qr_refresh_doc);
  m.def("qr_refresh", &qr_refresh_py<double>, "a"_a.noconvert(), "q_prev"_a.noconvert(), "scale"_a = 1.0,
        "skip_tol"_a = 0.0, qr_refresh_doc);
  m.def("simd_kernels", &linalg::simd_kernels,
        "The vector kernels of the in-house eigendecomposition and QR steps: 'avx512', 'avx2' or 'baseline', the "
        "widest the CPU runs, at most what ASTERIA_MAX_SIMD names; ValueError for a value of it that names none.");
}

}  // namespace asteria::bindings
