// Bindings of the numerics, for tests, benchmarks and a C++-free reference path.
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>

#include <cstdint>
#include <string>
#include <vector>

#include "asteria/common/errors.h"
#include "asteria/linalg/eigenbasis.h"
#include "asteria/linalg/inverse_root.h"
#include "bindings.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace asteria::bindings {

namespace {

template <typename T>
using Matrix = nb::ndarray<T, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

template <typename T>
nb::tuple inverse_root_py(Matrix<T> a, double exponent, double eps, double scale) {
  if (a.shape(0) != a.shape(1)) {
    throw InvalidArgument("Invalid a shape (" + std::to_string(a.shape(0)) + ", " + std::to_string(a.shape(1)) +
                          "): must be square");
  }
  const int n = static_cast<int>(a.shape(0));
  T* out = new T[static_cast<std::size_t>(n) * n];
  nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  linalg::RootReport report;
  {
    nb::gil_scoped_release release;
    report = linalg::inverse_root(n, a.data(), n, out, n, linalg::RootSpec{exponent, eps, scale});
  }
  nb::dict info;
  info["used_float64"] = report.used_float64;
  info["lambda_min"] = report.lambda_min;
  info["lambda_max"] = report.lambda_max;
  auto result = nb::ndarray<nb::numpy, T, nb::ndim<2>>(out, {a.shape(0), a.shape(1)}, owner);
  return nb::make_tuple(result, info);
}

template <typename T>
nb::ndarray<nb::numpy, T> owned_array(std::size_t rows, std::size_t cols, T* data) {
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  if (cols == 0) return nb::ndarray<nb::numpy, T>(data, {rows}, owner);
  return nb::ndarray<nb::numpy, T>(data, {rows, cols}, owner);
}

int square_dim(std::size_t rows, std::size_t cols, const char* name) {
  if (rows != cols) {
    throw InvalidArgument(std::string("Invalid ") + name + " shape (" + std::to_string(rows) + ", " +
                          std::to_string(cols) + "): must be square");
  }
  return static_cast<int>(rows);
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
  auto q_array = owned_array(nn, nn, q);
  T* values = new T[nn];
  auto values_array = owned_array<T>(nn, 0, values);
  linalg::BasisReport report;
  {
    nb::gil_scoped_release release;
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
  auto q_array = owned_array(nn, nn, q);
  T* estimates = new T[nn];
  auto estimates_array = owned_array<T>(nn, 0, estimates);
  std::vector<T> perm(nn);
  linalg::BasisReport report;
  {
    nb::gil_scoped_release release;
    report = linalg::qr_refresh(n, a.data(), q_prev.data(), q, estimates, perm.data(), scale, skip_tol);
  }
  auto* perm_out = new std::int64_t[nn];
  for (std::size_t j = 0; j < nn; ++j) perm_out[j] = static_cast<std::int64_t>(perm[j]);
  return nb::make_tuple(q_array, estimates_array, owned_array<std::int64_t>(nn, 0, perm_out), basis_info(report));
}

}  // namespace

void init_linalg(nb::module_& m) {
  constexpr const char* doc =
      "inverse_root(a, exponent, eps, scale=1.0) -> (root, info): (scale*A)^exponent of a symmetric matrix with "
      "eps added to the eigenvalues (shifted up first when the smallest is negative); float32 with a float64 "
      "retry; raises NumericalError on non-finite input or output. Releases the GIL.";
  m.def("inverse_root", &inverse_root_py<float>, "a"_a, "exponent"_a, "eps"_a, "scale"_a = 1.0, doc);
  m.def("inverse_root", &inverse_root_py<double>, "a"_a, "exponent"_a, "eps"_a, "scale"_a = 1.0, doc);

  constexpr const char* eigenbasis_doc =
      "eigenbasis(a, scale=1.0) -> (q, values, info): eigenvectors of scale*A as the columns of q, sorted by "
      "descending eigenvalue; float32 with a float64 retry; raises NumericalError on non-finite input or output. "
      "Releases the GIL.";
  m.def("eigenbasis", &eigenbasis_py<float>, "a"_a, "scale"_a = 1.0, eigenbasis_doc);
  m.def("eigenbasis", &eigenbasis_py<double>, "a"_a, "scale"_a = 1.0, eigenbasis_doc);
  constexpr const char* qr_refresh_doc =
      "qr_refresh(a, q_prev, scale=1.0, skip_tol=0.0) -> (q, estimates, perm, info): SOAP's warm-started "
      "refresh: T = scale*A @ q_prev, est = diag(q_prev.T @ T), perm = stable descending argsort(est), q = "
      "torch.linalg.qr(T[:, perm]).Q (LAPACK signs); with skip_tol > 0 a basis whose off-diagonal ratio is <= "
      "skip_tol is kept (q = q_prev, identity perm, unsorted estimates). Releases the GIL.";
  m.def("qr_refresh", &qr_refresh_py<float>, "a"_a, "q_prev"_a, "scale"_a = 1.0, "skip_tol"_a = 0.0, qr_refresh_doc);
  m.def("qr_refresh", &qr_refresh_py<double>, "a"_a, "q_prev"_a, "scale"_a = 1.0, "skip_tol"_a = 0.0,
        qr_refresh_doc);
}

}  // namespace asteria::bindings
