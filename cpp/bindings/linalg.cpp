// Bindings of the numerics, for tests, benchmarks and a C++-free reference path.
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>

#include <string>

#include "asteria/common/errors.h"
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

}  // namespace

void init_linalg(nb::module_& m) {
  constexpr const char* doc =
      "inverse_root(a, exponent, eps, scale=1.0) -> (root, info): (scale*A)^exponent of a symmetric matrix with "
      "eps added to the eigenvalues (shifted up first when the smallest is negative); float32 with a float64 "
      "retry; raises NumericalError on non-finite input or output. Releases the GIL.";
  m.def("inverse_root", &inverse_root_py<float>, "a"_a, "exponent"_a, "eps"_a, "scale"_a = 1.0, doc);
  m.def("inverse_root", &inverse_root_py<double>, "a"_a, "exponent"_a, "eps"_a, "scale"_a = 1.0, doc);
}

}  // namespace asteria::bindings
